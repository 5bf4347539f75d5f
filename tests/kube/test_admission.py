"""The API server stops the applier's ServiceAccount from writing anything but vmstream's
own changes: deploy/base/admission-apply.yaml (a ValidatingAdmissionPolicy) on a real
kube-apiserver, with deploy/base/rbac-apply.yaml's ClusterRole.

Requests are made *as* the applier (``Impersonate-User``); each forbidden write is checked
twice — the API server answered 403 with the policy's message, and the object is as it was.
The allowed writes are exactly the applier's: a GPU patch planned by the GPU rules, a VM
created as the handlers write it, a cordon with vmstream's annotation and its uncordon, a
VMI deleted in a project namespace.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes import client
from kubernetes.client.rest import ApiException

from handlers.contracts.messages import GPUMutation
from handlers.rules import policy
from handlers.rules.gpus import desired_vm, plan_patch
from samples.cluster import A100, PROJECT_LABEL
from samples.cluster import node as node_object
from samples.cluster import vm as vm_object
from streams.kube.applying import RESTART_ANNOTATION
from tests.support.kube_apiserver import Kube, as_others_write_it
from tests.support.waiting import eventually

pytestmark = pytest.mark.kube

ROOT = Path(__file__).resolve().parents[2]
APPLIER = "system:serviceaccount:vmstream:vmstream-apply"
KUBEVIRT = ("kubevirt.io", "v1")
JSON_PATCH = "application/json-patch+json"
MERGE_PATCH = "application/merge-patch+json"
DENIED_BY = "ValidatingAdmissionPolicy 'vmstream-apply'"
ADD_A100 = GPUMutation(device_name=A100, eviction_strategy="External")


def manifests(name: str) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all((ROOT / "deploy" / "base" / name).read_text()) if doc]


def _create_or_replace(api: client.ApiClient, obj: dict[str, Any]) -> None:
    dynamic = {
        "ValidatingAdmissionPolicy": ("admissionregistration.k8s.io", "v1", "validatingadmissionpolicies"),
        "ValidatingAdmissionPolicyBinding": ("admissionregistration.k8s.io", "v1",
                                             "validatingadmissionpolicybindings"),
        "ClusterRole": ("rbac.authorization.k8s.io", "v1", "clusterroles"),
        "ClusterRoleBinding": ("rbac.authorization.k8s.io", "v1", "clusterrolebindings"),
    }
    group, version, plural = dynamic[obj["kind"]]
    custom = client.CustomObjectsApi(api)
    try:
        custom.create_cluster_custom_object(group, version, plural, obj)
    except ApiException as exc:
        if exc.status != 409:
            raise
        live = custom.get_cluster_custom_object(group, version, plural, obj["metadata"]["name"])
        replacement = {**obj, "metadata": {**obj["metadata"], "resourceVersion": live["metadata"]["resourceVersion"]}}
        custom.replace_cluster_custom_object(group, version, plural, obj["metadata"]["name"], replacement)


def _delete(api: client.ApiClient, obj: dict[str, Any]) -> None:
    group, _, version = obj["apiVersion"].rpartition("/")
    plural = {"ValidatingAdmissionPolicy": "validatingadmissionpolicies",
              "ValidatingAdmissionPolicyBinding": "validatingadmissionpolicybindings",
              "ClusterRoleBinding": "clusterrolebindings", "ClusterRole": "clusterroles"}[obj["kind"]]
    try:
        client.CustomObjectsApi(api).delete_cluster_custom_object(group, version, plural, obj["metadata"]["name"])
    except ApiException as exc:
        if exc.status != 404:
            raise


def status_of(call: Callable[[], object]) -> tuple[int, str]:
    """(HTTP status, the API server's message) of a request."""
    try:
        call()
    except ApiException as exc:
        return int(exc.status), str(exc.body)
    return 200, ""


def denied_by_policy(call: Callable[[], object]) -> str:
    status, body = status_of(call)
    assert status == 403 and DENIED_BY in body, (status, body)
    return body


@pytest.fixture(scope="module")
def admin(kube: Kube) -> Iterator[client.ApiClient]:
    with kube.api_client() as api:
        yield api


@pytest.fixture(scope="module")
def applier(kube: Kube, admin: client.ApiClient) -> Iterator[client.ApiClient]:
    """The applier's identity (RBAC + the admission policy, created for this module)."""
    made = [*manifests("rbac-apply.yaml"), *manifests("admission-apply.yaml")]
    for obj in made:
        _create_or_replace(admin, obj)
    with kube.api_client() as api:
        api.set_default_header("Impersonate-User", APPLIER)
        probe = f"probe-{uuid.uuid4().hex[:8]}"
        core = client.CoreV1Api(admin)
        core.create_node(_node(probe, labels={"node-role.kubernetes.io/control-plane": ""}))
        try:
            # Policies take effect once the API server has loaded them: until a cordon of a
            # control-plane node (a dry run, allowed by RBAC) is refused by the policy.
            deadline = time.monotonic() + 60
            while True:
                status, body = status_of(lambda: client.CoreV1Api(api).patch_node(
                    probe, {"spec": {"unschedulable": True}}, dry_run="All"))
                if status == 403 and DENIED_BY in body:
                    break
                assert DENIED_BY not in body, body  # loaded, but it does not answer as it should
                assert time.monotonic() < deadline, f"the admission policy never took effect: {status} {body}"
                time.sleep(0.2)  # polling interval
            yield api
        finally:
            core.delete_node(probe)
            # Other tests act as this ServiceAccount too and expect RBAC alone.
            for obj in reversed(manifests("admission-apply.yaml")):
                _delete(admin, obj)


@pytest.fixture
def project(kube_namespace: str, admin: client.ApiClient, applier: client.ApiClient) -> str:
    """A project namespace (proj-a), once the admission policy sees its label: the policy
    reads namespaces from the API server's informer cache, which may lag the patch."""
    client.CoreV1Api(admin).patch_namespace(kube_namespace, {"metadata": {"labels": {PROJECT_LABEL: "proj-a"}}})
    custom = client.CustomObjectsApi(applier)

    def seen_as_project() -> bool:
        status, body = status_of(lambda: custom.create_namespaced_custom_object(
            *KUBEVIRT, kube_namespace, "virtualmachines", _vm(kube_namespace, "probe"), dry_run="All"))
        return status == 200 or "project namespaces" not in body

    eventually(seen_as_project, f"the admission policy to see {kube_namespace} as a project namespace", timeout=30)
    return kube_namespace


def _node(name: str, *, labels: dict[str, str] | None = None, annotations: dict[str, str] | None = None,
          unschedulable: bool = False) -> dict[str, Any]:
    obj = node_object(name, gpus={A100: 1}, unschedulable=unschedulable)
    for field in ("uid", "resourceVersion"):
        del obj["metadata"][field]
    obj["metadata"]["labels"].update(labels or {})
    if annotations:
        obj["metadata"]["annotations"] = annotations
    return obj


@pytest.fixture
def make_node(admin: client.ApiClient) -> Iterator[Callable[..., str]]:
    core = client.CoreV1Api(admin)
    made: list[str] = []

    def make(**kwargs: Any) -> str:
        name = f"node-{uuid.uuid4().hex[:8]}"
        core.create_node(_node(name, **kwargs))
        made.append(name)
        return name

    yield make
    for name in made:
        core.delete_node(name)


def _vm(namespace: str, name: str, **labels: str) -> dict[str, Any]:
    obj = vm_object(namespace, name, project="proj-a", owner="alice@example.com")
    for field in ("uid", "resourceVersion", "generation"):
        del obj["metadata"][field]
    obj["metadata"]["labels"].update({"app.kubernetes.io/managed-by": "vmstream", **labels})
    return obj


def get_vm(api: client.ApiClient, namespace: str, name: str) -> dict[str, Any]:
    found: dict[str, Any] = client.CustomObjectsApi(api).get_namespaced_custom_object(
        *KUBEVIRT, namespace, "virtualmachines", name)
    return found


# ---------------------------------------------------------------------------- VMs


def test_a_gpu_patch_passes_and_nothing_else_does(admin: client.ApiClient, applier: client.ApiClient,
                                                  project: str) -> None:
    created = client.CustomObjectsApi(admin).create_namespaced_custom_object(
        *KUBEVIRT, project, "virtualmachines", _vm(project, "vm-1"))
    custom = client.CustomObjectsApi(applier)

    def patch(ops: list[dict[str, Any]]) -> Callable[[], object]:
        return lambda: custom.patch_namespaced_custom_object(*KUBEVIRT, project, "virtualmachines", "vm-1", ops,
                                                             _content_type=JSON_PATCH)

    attacks: dict[str, list[dict[str, Any]]] = {
        "SSH key": [{"op": "add", "path": "/spec/template/spec/accessCredentials", "value": [
            {"sshPublicKey": {"source": {"secret": {"secretName": "mallory-key"}},
                              "propagationMethod": {"qemuGuestAgent": {"users": ["root"]}}}}]}],
        "owner": [{"op": "replace", "path": "/metadata/annotations/vmstream.io~1owner",
                   "value": "mallory@example.com"}],
        "project": [{"op": "replace", "path": f"/metadata/labels/{PROJECT_LABEL.replace('/', '~1')}",
                     "value": "proj-b"}],
        "run strategy": [{"op": "replace", "path": "/spec/runStrategy", "value": "Halted"}],
        "cores": [{"op": "replace", "path": "/spec/template/spec/domain/cpu/cores", "value": 32}],
        "disks": [{"op": "remove", "path": "/spec/template/spec/domain/devices/disks"}],
    }
    for what, ops in attacks.items():
        assert "only at its GPU fields" in denied_by_policy(patch(ops)), what
    assert as_others_write_it(get_vm(admin, project, "vm-1")) == as_others_write_it(created)

    gpu = plan_patch(created, desired_vm(created, ADD_A100))
    assert status_of(patch(gpu)) == (200, "")
    devices = get_vm(admin, project, "vm-1")["spec"]["template"]["spec"]["domain"]["devices"]
    assert devices["gpus"] == [{"name": "gpu-0", "deviceName": A100}]
    # What the applier records before a restart, as it records it.
    record = {"metadata": {"annotations": {RESTART_ANNOTATION: '{"command_id": "cmd-1", "vmi_uid": "u"}'}}}
    assert status_of(lambda: custom.patch_namespaced_custom_object(
        *KUBEVIRT, project, "virtualmachines", "vm-1", record, _content_type=MERGE_PATCH)) == (200, "")


def test_vm_writes_only_in_project_namespaces(admin: client.ApiClient, applier: client.ApiClient,
                                              kube_namespace: str) -> None:
    custom = client.CustomObjectsApi(applier)
    # kube-system, and a namespace without the project label: no creation, no patch.
    for namespace in ("kube-system", kube_namespace):
        body = denied_by_policy(lambda: custom.create_namespaced_custom_object(
            *KUBEVIRT, namespace, "virtualmachines", _vm(namespace, "intruder")))
        assert "only in project namespaces" in body
    client.CustomObjectsApi(admin).create_namespaced_custom_object(
        *KUBEVIRT, "kube-system", "virtualmachines", _vm("kube-system", f"sys-{kube_namespace}"))
    try:
        denied_by_policy(lambda: custom.patch_namespaced_custom_object(
            *KUBEVIRT, "kube-system", "virtualmachines", f"sys-{kube_namespace}",
            {"metadata": {"annotations": {"vmstream.io/owner": "mallory@example.com"}}}, _content_type=MERGE_PATCH))
        assert get_vm(admin, "kube-system", f"sys-{kube_namespace}")["metadata"]["annotations"] == {
            "vmstream.io/owner": "alice@example.com"}
    finally:
        client.CustomObjectsApi(admin).delete_namespaced_custom_object(
            *KUBEVIRT, "kube-system", "virtualmachines", f"sys-{kube_namespace}")


def test_a_vm_is_created_only_as_vmstream_writes_it(applier: client.ApiClient, admin: client.ApiClient,
                                                    project: str) -> None:
    custom = client.CustomObjectsApi(applier)

    def create(obj: dict[str, Any]) -> Callable[[], object]:
        return lambda: custom.create_namespaced_custom_object(*KUBEVIRT, project, "virtualmachines", obj)

    unmanaged = _vm(project, "unmanaged")
    del unmanaged["metadata"]["labels"]["app.kubernetes.io/managed-by"]
    other_project = _vm(project, "other", **{PROJECT_LABEL: "proj-b"})
    ownerless = _vm(project, "ownerless")
    del ownerless["metadata"]["annotations"]
    for obj in (unmanaged, other_project, ownerless):
        assert "only managed by vmstream" in denied_by_policy(create(obj)), obj["metadata"]["name"]
    assert status_of(create(_vm(project, "good"))) == (200, "")
    names = {vm["metadata"]["name"] for vm in client.CustomObjectsApi(admin).list_namespaced_custom_object(
        *KUBEVIRT, project, "virtualmachines")["items"]}
    assert names == {"good"}


# ---------------------------------------------------------------------------- VMIs


def _vmi(namespace: str, name: str) -> dict[str, Any]:
    return {"apiVersion": "kubevirt.io/v1", "kind": "VirtualMachineInstance",
            "metadata": {"name": name, "namespace": namespace},
            "spec": {"domain": {"devices": {}, "memory": {"guest": "128Mi"}}}}


def test_vmis_are_deleted_only_in_project_namespaces(admin: client.ApiClient, applier: client.ApiClient,
                                                     project: str) -> None:
    admin_custom = client.CustomObjectsApi(admin)
    system_vmi = f"sys-{project}"
    admin_custom.create_namespaced_custom_object(*KUBEVIRT, "kube-system", "virtualmachineinstances",
                                                 _vmi("kube-system", system_vmi))
    admin_custom.create_namespaced_custom_object(*KUBEVIRT, project, "virtualmachineinstances", _vmi(project, "vm-1"))
    custom = client.CustomObjectsApi(applier)
    try:
        denied_by_policy(lambda: custom.delete_namespaced_custom_object(
            *KUBEVIRT, "kube-system", "virtualmachineinstances", system_vmi))
        assert admin_custom.get_namespaced_custom_object(*KUBEVIRT, "kube-system", "virtualmachineinstances",
                                                         system_vmi)
    finally:
        admin_custom.delete_namespaced_custom_object(*KUBEVIRT, "kube-system", "virtualmachineinstances", system_vmi)
    assert status_of(lambda: custom.delete_namespaced_custom_object(
        *KUBEVIRT, project, "virtualmachineinstances", "vm-1")) == (200, "")


# ---------------------------------------------------------------------------- nodes


def test_nodes_only_cordoned_and_uncordoned_as_vmstream_does(
    admin: client.ApiClient, applier: client.ApiClient, make_node: Callable[..., str]
) -> None:
    core = client.CoreV1Api(applier)
    annotated = {"metadata": {"annotations": {policy.CORDONED_ANNOTATION: "cmd-1"}}, "spec": {"unschedulable": True}}
    uncordon = {"metadata": {"annotations": {policy.CORDONED_ANNOTATION: None}}, "spec": {"unschedulable": None}}

    control_plane = make_node(labels={"node-role.kubernetes.io/control-plane": ""})
    assert "control-plane" in denied_by_policy(lambda: core.patch_node(control_plane, annotated))

    gpu_node = make_node()
    for forbidden in ({"metadata": {"labels": {"evil": "yes"}}},
                      {"metadata": {"annotations": {"other.io/x": "y"}}},
                      {"spec": {"taints": [{"key": "k", "effect": "NoSchedule"}]}},
                      {"spec": {"podCIDR": "10.9.0.0/24"}}):
        denied_by_policy(lambda: core.patch_node(gpu_node, forbidden))
    assert status_of(lambda: core.patch_node(gpu_node, annotated)) == (200, "")
    assert status_of(lambda: core.patch_node(gpu_node, uncordon)) == (200, "")
    node = client.CoreV1Api(admin).read_node(gpu_node)
    assert not node.spec.unschedulable and policy.CORDONED_ANNOTATION not in (node.metadata.annotations or {})
    assert node.metadata.labels == {"kubernetes.io/hostname": gpu_node}

    by_hand = make_node(unschedulable=True)  # an operator's cordon: not vmstream's to undo
    assert "uncordon only what it cordoned" in denied_by_policy(lambda: core.patch_node(by_hand, uncordon))
    assert client.CoreV1Api(admin).read_node(by_hand).spec.unschedulable


# ---------------------------------------------------------------------------- anything else


def test_a_write_rbac_would_allow_is_still_denied(admin: client.ApiClient, applier: client.ApiClient,
                                                  project: str) -> None:
    """Should the ClusterRole ever grow, the policy still refuses anything else."""
    name = f"vmstream-apply-extra-{uuid.uuid4().hex[:6]}"
    role = {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRole", "metadata": {"name": name},
            "rules": [{"apiGroups": [""], "resources": ["configmaps"], "verbs": ["create"]},
                      {"apiGroups": ["kubevirt.io"], "resources": ["virtualmachines"], "verbs": ["delete"]}]}
    binding = {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding",
               "metadata": {"name": name},
               "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": name},
               "subjects": [{"kind": "ServiceAccount", "name": "vmstream-apply", "namespace": "vmstream"}]}
    for obj in (role, binding):
        _create_or_replace(admin, obj)
    client.CustomObjectsApi(admin).create_namespaced_custom_object(
        *KUBEVIRT, project, "virtualmachines", _vm(project, "keep"))
    try:
        authz = client.AuthorizationV1Api(admin)

        def rbac_allows(verb: str, resource: str, group: str) -> bool:
            review = client.V1SubjectAccessReview(spec=client.V1SubjectAccessReviewSpec(
                user=APPLIER, resource_attributes=client.V1ResourceAttributes(
                    group=group, resource=resource, verb=verb, namespace=project)))
            return bool(authz.create_subject_access_review(review).status.allowed)

        eventually_allowed = time.monotonic() + 30
        while not rbac_allows("create", "configmaps", ""):  # RBAC's cache: the binding is new
            assert time.monotonic() < eventually_allowed, "RBAC never granted the extra role"
            time.sleep(0.2)  # polling interval
        assert rbac_allows("delete", "virtualmachines", "kubevirt.io")
        configmap = client.V1ConfigMap(metadata=client.V1ObjectMeta(name="planted"), data={"a": "b"})
        assert "may not CREATE /configmaps" in denied_by_policy(
            lambda: client.CoreV1Api(applier).create_namespaced_config_map(project, configmap))
        assert "may not DELETE kubevirt.io/virtualmachines" in denied_by_policy(
            lambda: client.CustomObjectsApi(applier).delete_namespaced_custom_object(
                *KUBEVIRT, project, "virtualmachines", "keep"))
        assert get_vm(admin, project, "keep")
    finally:
        for obj in (binding, role):
            _delete(admin, obj)


def test_subject_access_reviews_for_the_applier(admin: client.ApiClient, applier: client.ApiClient) -> None:
    """What RBAC lets the applier do: read, list and watch namespaces (for its policy's copy,
    streams/kube/informing.py), nothing wider."""
    authz = client.AuthorizationV1Api(admin)

    def allowed(verb: str, resource: str, group: str = "", namespace: str | None = None) -> bool:
        review = client.V1SubjectAccessReview(spec=client.V1SubjectAccessReviewSpec(
            user=APPLIER, groups=["system:serviceaccounts", "system:serviceaccounts:vmstream"],
            resource_attributes=client.V1ResourceAttributes(group=group, resource=resource, verb=verb,
                                                             namespace=namespace)))
        return bool(authz.create_subject_access_review(review).status.allowed)

    for verb in ("get", "list", "watch"):
        assert allowed(verb, "namespaces")
        assert allowed(verb, "virtualmachines", "kubevirt.io")
    assert allowed("patch", "nodes")
    assert allowed("patch", "virtualmachines", "kubevirt.io", "kube-system")  # RBAC alone: the policy narrows it
    for verb, resource, group in (("list", "nodes", ""), ("list", "virtualmachineinstances", "kubevirt.io"),
                                  ("update", "namespaces", ""),
                                  ("patch", "namespaces", ""), ("get", "secrets", ""),
                                  ("delete", "nodes", ""), ("delete", "virtualmachines", "kubevirt.io"),
                                  ("patch", "nodes/status", ""),
                                  ("create", "validatingadmissionpolicies", "admissionregistration.k8s.io")):
        assert not allowed(verb, resource, group), (verb, resource)
