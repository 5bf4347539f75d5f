"""The applier's policy reads from a watched copy (streams/kube/informing.py), on a real API server.

The copy lists, then follows a watch, and lists again after ``410 Gone``; with it current a
``patch_vm`` costs the API server one request (the patch) instead of three. It must leave the
policy as safe as live reads (docs/security.md, "Reads from a cache"): a VM copy that lags is
a 409 and a plan on the live VM, never a write past another writer; a namespace the copy calls
no project's is read again live before a refusal; a copy that is not current is not read.
"""

from __future__ import annotations

import json
from datetime import UTC, datetime
from collections.abc import Iterator
from typing import Any
from urllib.parse import urlsplit

import pytest
from kubernetes import client

from handlers.contracts import ids
from handlers.contracts.messages import Command, ObjectRef
from handlers.core.decisions import subject_key
from samples.cluster import A100, PROJECT_LABEL
from samples.cluster import vm as scenario_vm
from streams.kube.applying import KUBEVIRT, KubeApplier
from streams.kube.informing import NAMESPACES, UNKNOWN, Informer, PolicyCache
from tests.support.harness import Harness
from tests.support.kube_apiserver import Kube, reconciled_vm
from tests.support.waiting import eventually

pytestmark = pytest.mark.kube

OWNER = "alice@example.com"


@pytest.fixture
def project_namespace(kube_namespace: str, api: client.ApiClient) -> str:
    client.CoreV1Api(api).patch_namespace(kube_namespace, {"metadata": {"labels": {PROJECT_LABEL: "proj-a"}}})
    return kube_namespace


@pytest.fixture
def cache(api: client.ApiClient) -> Iterator[PolicyCache]:
    started = PolicyCache(api).start()
    try:
        assert started.wait_synced(60), "the copy was never listed"
        eventually(started.namespaces.current, "the copy's watch open")
        yield started
    finally:
        started.stop()


def create_vm(api: client.ApiClient, namespace: str, name: str) -> dict[str, Any]:
    """A project's VM without a GPU, as the API server stores it once virt-controller has
    reconciled it."""
    body = scenario_vm(namespace, name, project="proj-a", owner=OWNER, run_strategy="Halted")
    for field in ("uid", "resourceVersion", "generation"):
        del body["metadata"][field]
    client.CustomObjectsApi(api).create_namespaced_custom_object(*KUBEVIRT, namespace, "virtualmachines", body)
    return reconciled_vm(api, namespace, name)


def get_vm(api: client.ApiClient, namespace: str, name: str) -> dict[str, Any]:
    vm: dict[str, Any] = client.CustomObjectsApi(api).get_namespaced_custom_object(
        *KUBEVIRT, namespace, "virtualmachines", name)
    return vm


def set_gpu(vm: dict[str, Any]) -> Command:
    """The ``patch_vm`` the engine decides for a set_gpu on ``vm`` as observed."""
    harness = Harness()
    harness.observe(vm)
    meta = vm["metadata"]
    [command] = harness.intent("set_gpu", {"namespace": meta["namespace"], "name": meta["name"],
                                           "gpu_class": "nvidia-a100"}, by=OWNER).decision.commands
    return command


def requests_sent(api: client.ApiClient) -> list[tuple[str, str]]:
    """(method, path) of every request ``api`` sends from now on. Counted at the client: the
    API server also answers KubeVirt's controllers, which act on the same VM meanwhile."""
    sent: list[tuple[str, str]] = []
    send = api.rest_client.request

    def request(method: str, url: str, *args: Any, **kwargs: Any) -> Any:
        sent.append((method, urlsplit(url).path))
        return send(method, url, *args, **kwargs)

    api.rest_client.request = request
    return sent


class StaleCache(PolicyCache):
    """A copy that lags: it shows what it was given, whatever the API server holds now."""

    def __init__(self, labels: dict[str, str] | None = None, vm: dict[str, Any] | None = None) -> None:
        self.labels, self.copy = labels, vm  # no informers: nothing is watched

    def namespace_labels(self, name: str) -> dict[str, str] | None:
        return self.labels

    def vm(self, namespace: str, name: str, resource_version: str | None) -> dict[str, Any] | None:
        return self.copy


def project_label_gone(cache: PolicyCache, namespace: str) -> bool:
    """The copy is current and shows the namespace without its project label."""
    labels = cache.namespace_labels(namespace)
    return isinstance(labels, dict) and PROJECT_LABEL not in labels


# ------------------------------------------------------------------------------ the copy


def test_the_copy_is_listed_then_follows_the_watch(
    api: client.ApiClient, project_namespace: str, cache: PolicyCache
) -> None:
    assert cache.vms.synced.is_set()
    labels = cache.namespace_labels(project_namespace)
    assert isinstance(labels, dict) and labels.get(PROJECT_LABEL) == "proj-a"
    created = create_vm(api, project_namespace, "vm-1")
    custom = client.CustomObjectsApi(api)

    def current() -> str:  # virt-controller writes the VM too (finalizer, status): its latest version
        found: dict[str, Any] = custom.get_namespaced_custom_object(*KUBEVIRT, project_namespace, "virtualmachines",
                                                                     "vm-1")
        return str(found["metadata"]["resourceVersion"])

    copy = eventually(lambda: cache.vm(project_namespace, "vm-1", current()), "the VM in the copy")
    rv = copy["metadata"]["resourceVersion"]
    assert copy["spec"] == created["spec"]
    copy["spec"]["runStrategy"] = "Always"  # a copy handed out is the caller's own
    again = cache.vm(project_namespace, "vm-1", rv)
    assert again is not None and again["spec"] == created["spec"]

    custom.patch_namespaced_custom_object(
        *KUBEVIRT, project_namespace, "virtualmachines", "vm-1", {"metadata": {"labels": {"team": "blue"}}})
    patched = eventually(lambda: cache.vm(project_namespace, "vm-1", current()), "the patched VM in the copy")
    assert patched["metadata"]["labels"]["team"] == "blue"
    assert cache.vm(project_namespace, "vm-1", rv) is None  # not the version asked for

    client.CoreV1Api(api).patch_namespace(project_namespace, {"metadata": {"labels": {PROJECT_LABEL: None}}})
    eventually(lambda: project_label_gone(cache, project_namespace), "the label gone from the copy")
    client.CustomObjectsApi(api).delete_namespaced_custom_object(*KUBEVIRT, project_namespace, "virtualmachines",
                                                                 "vm-1")
    eventually(lambda: cache.vms.get(f"{project_namespace}/vm-1") is None, "the VM gone from the copy")

    cache.stop()
    assert not cache.namespaces.current()
    assert cache.namespace_labels(project_namespace) is UNKNOWN  # not current: not read


class ScriptedServer:
    """Answers an informer's requests from a script: a list, then watches.

    The one stand-in here: a real API server answers ``410 Gone`` only once its watch cache
    has dropped the resourceVersion, which no test can bring about on demand.
    """

    def __init__(self, answers: list[list[dict[str, Any]] | dict[str, Any]]) -> None:
        self.answers = answers
        self.asked: list[dict[str, str]] = []

    def call_api(self, path: str, method: str, *, query_params: list[tuple[str, str]], **_: Any) -> Any:
        self.asked.append(dict(query_params))
        answer: Any = self.answers.pop(0) if self.answers else []
        return ScriptedResponse(answer)


class ScriptedResponse:
    def __init__(self, answer: list[dict[str, Any]] | dict[str, Any]) -> None:
        if isinstance(answer, list):  # a watch: its events, one JSON line each
            self.data = b"".join(json.dumps(event).encode() + b"\n" for event in answer)
        else:  # a list
            self.data = json.dumps(answer).encode()

    def stream(self, amt: Any = None, decode_content: bool = False) -> Iterator[bytes]:
        yield self.data

    def release_conn(self) -> None:
        pass

    def shutdown(self) -> None:
        pass


def namespace(name: str, rv: str) -> dict[str, Any]:
    return {"metadata": {"name": name, "resourceVersion": rv, "labels": {PROJECT_LABEL: name}}}


def test_a_watch_too_old_to_resume_lists_again() -> None:
    """``410 Gone`` in the watch: the copy is listed again, and what the new list lacks is gone."""
    server = ScriptedServer([
        {"metadata": {"resourceVersion": "5"}, "items": [namespace("a", "4")]},
        [{"type": "ADDED", "object": namespace("b", "6")},
         {"type": "ERROR", "object": {"kind": "Status", "code": 410, "message": "too old resource version"}}],
        {"metadata": {"resourceVersion": "9"}, "items": [namespace("b", "6")]},
    ])
    informer = Informer(server, NAMESPACES)
    assert not informer.synced.is_set() and not informer.current()  # nothing before the first list
    informer.start()
    try:
        eventually(lambda: informer.lists == 2, "the copy listed again after 410 Gone")
        assert informer.get("a") is None and informer.get("b") is not None
        assert [asked.get("resourceVersion") for asked in server.asked[:3]] == [None, "5", None]
        eventually(lambda: len(server.asked) > 3, "a watch from the new list")
        assert server.asked[3].get("resourceVersion") == "9"
    finally:
        informer.stop()


# ------------------------------------------------------------------- the policy with it


def test_with_a_current_copy_a_patch_costs_the_api_server_one_request(
    api: client.ApiClient, kube: Kube, project_namespace: str, cache: PolicyCache
) -> None:
    vm = create_vm(api, project_namespace, "vm-1")
    command = set_gpu(vm)
    eventually(lambda: cache.vm(project_namespace, "vm-1", command.base_resource_version), "the VM in the copy")
    with kube.api_client() as applier_api:
        sent = requests_sent(applier_api)
        applied = KubeApplier(applier_api, cache=cache).apply(command)
    assert applied.outcome == "applied"
    assert sent == [("PATCH", f"/apis/kubevirt.io/v1/namespaces/{project_namespace}/virtualmachines/vm-1")]


def test_a_vm_copy_that_lags_is_a_conflict_and_a_plan_on_the_live_vm(
    api: client.ApiClient, project_namespace: str
) -> None:
    vm = create_vm(api, project_namespace, "vm-1")
    command = set_gpu(vm)
    # Another writer changes the VM; the copy has not seen it yet.
    client.CustomObjectsApi(api).patch_namespaced_custom_object(
        *KUBEVIRT, project_namespace, "virtualmachines", "vm-1", {"metadata": {"labels": {"team": "blue"}}})
    stale = StaleCache({PROJECT_LABEL: "proj-a"}, vm)
    applied = KubeApplier(api, cache=stale).apply(command)
    assert applied.outcome == "conflict_retried"
    stored = get_vm(api, project_namespace, "vm-1")
    assert stored["metadata"]["labels"]["team"] == "blue"  # the other writer's change kept
    assert stored["spec"]["template"]["spec"]["domain"]["devices"]["gpus"][0]["deviceName"] == A100


def test_a_namespace_the_copy_calls_no_projects_is_read_again_before_a_refusal(
    api: client.ApiClient, project_namespace: str
) -> None:
    """Labelled a moment ago, not yet in the copy: applied, not refused."""
    command = set_gpu(create_vm(api, project_namespace, "vm-1"))
    applied = KubeApplier(api, cache=StaleCache({}, None)).apply(command)
    assert applied.outcome == "applied" and not applied.refused
    # A copy without the namespace at all (created a moment ago): read again too.
    again = KubeApplier(api, cache=StaleCache(None, None)).apply(command)
    assert again.outcome == "noop" and not again.refused  # the GPU is there already


def test_a_namespace_no_longer_a_projects_is_refused_once_the_copy_shows_it(
    api: client.ApiClient, kube_namespace: str, cache: PolicyCache
) -> None:
    client.CoreV1Api(api).patch_namespace(kube_namespace, {"metadata": {"labels": {PROJECT_LABEL: "proj-a"}}})
    vm = create_vm(api, kube_namespace, "vm-1")
    client.CoreV1Api(api).patch_namespace(kube_namespace, {"metadata": {"labels": {PROJECT_LABEL: None}}})
    eventually(lambda: project_label_gone(cache, kube_namespace), "the label gone from the copy")
    applied = KubeApplier(api, cache=cache).apply(set_gpu(vm))
    assert applied.refused and "not a project namespace" in (applied.error or "")
    assert "gpus" not in get_vm(api, kube_namespace, "vm-1")["spec"]["template"]["spec"]["domain"]["devices"]


def test_a_start_stop_or_restart_reads_the_namespace_live_whatever_the_copy_says(
    api: client.ApiClient, kube_namespace: str
) -> None:
    """virt-api's writes pass no admission policy of vmstream's: their namespace is never
    judged on the copy, even one that calls it a project's."""
    client.CoreV1Api(api).patch_namespace(kube_namespace, {"metadata": {"labels": {PROJECT_LABEL: "proj-a"}}})
    create_vm(api, kube_namespace, "vm-1")
    client.CoreV1Api(api).patch_namespace(kube_namespace, {"metadata": {"labels": {PROJECT_LABEL: None}}})
    stale = StaleCache({PROJECT_LABEL: "proj-a"}, None)
    for type_ in ("start_vm", "stop_vm", "restart_vm"):
        target = ObjectRef(kind="VirtualMachine", namespace=kube_namespace, name="vm-1")
        cause = f"test-{type_}"
        command = Command(command_id=ids.command_id(cause, type_, subject_key(target)), type=type_, target=target,
                          cause=cause, issued_at=datetime.now(UTC), requested_by=OWNER)
        applied = KubeApplier(api, cache=stale).apply(command)
        assert applied.refused and "not a project namespace" in (applied.error or ""), type_
