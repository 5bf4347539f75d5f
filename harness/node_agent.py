"""A STAND-IN, never shipped: the node agent, playing the parts that cannot run here.

The local control plane runs KubeVirt's own virt-controller and virt-api
(``harness.localkubevirt``) for the demo and the tests, but no kube-scheduler, no kubelet and no virt-handler: there are
no containers and no QEMU on this machine. This agent plays exactly those three, as thinly as
it can, polling the real API server on a background thread:

* **kube-scheduler** — binds each unbound virt-launcher pod to the first Ready, schedulable
  Node (by name) that matches the pod's ``nodeSelector`` and still has every device the pod
  requests (the extended resources of its containers, e.g. ``nvidia.com/GA102GL_A10``, counted
  against ``allocatable`` minus what the pods bound there hold). A pod that fits nowhere stays
  Pending with ``PodScheduled=False`` (``Unschedulable``), as the scheduler leaves it, and is
  bound on a later pass once a device frees up. What the kubelet and virt-handler would put on
  every node is taken as there without writing it: the labels virt-launcher pods select
  (``kubernetes.io/arch=amd64``, ``kubevirt.io/schedulable=true``, virt-handler's node
  labeller's ``*.node.kubevirt.io/*``) and virt-handler's device plugins
  (``devices.kubevirt.io/kvm``, ``tun``, ``vhost-net``).
* **kubelet** — marks a bound pod Running with its containers started, and removes a pod once
  it is marked for deletion (the kubelet would stop its containers first).
* **virt-handler** — moves a ``Scheduled`` VMI on its node to ``Running`` (the domain
  started) and a VMI being deleted to ``Succeeded`` (the guest shut down), appending
  ``phaseTransitionTimestamps``;
  :meth:`NodeAgent.fail` and :meth:`NodeAgent.finish` end a VMI as a crash or a shutdown from
  inside the guest would. It writes VMIs as ``system:serviceaccount:kubevirt:kubevirt-handler``:
  virt-api reverts VMI status written by anyone but KubeVirt's service accounts.

Everything else — VMIs per run strategy, launcher pods, ``RestartRequired``, the
start/stop/restart subresources, eviction marking — is KubeVirt's own code.
"""

from __future__ import annotations

import json
import logging
import threading
from collections import Counter
from collections.abc import Callable, Iterable
from datetime import UTC, datetime
from types import TracebackType
from typing import Any

from kubernetes import client
from kubernetes.client.rest import ApiException

log = logging.getLogger(__name__)

GROUP, VERSION = "kubevirt.io", "v1"
LAUNCHER_SELECTOR = "kubevirt.io=virt-launcher"
# What the kubelet and virt-handler label every node with, as far as launcher pods select it.
EVERY_NODE_LABELS = {"kubernetes.io/arch": "amd64", "kubevirt.io/schedulable": "true"}
NODE_LABELLER_SUFFIX = ".node.kubevirt.io"  # e.g. machine-type.node.kubevirt.io/q35: what the host supports
HANDLER_DEVICES = "devices.kubevirt.io/"  # virt-handler's device plugins: kvm, tun, vhost-net
ENDED_PODS = frozenset({"Succeeded", "Failed"})
NOT_DEVICES = ("cpu", "memory", "ephemeral-storage", "pods")


def _now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _quantity(value: Any) -> int:
    """A device count; ``1k`` as the device plugins write it."""
    text = str(value)
    return int(text[:-1]) * 1000 if text.endswith("k") else int(text)


def devices_requested(pod: dict[str, Any]) -> Counter[str]:
    """The extended resources (devices) a pod's containers ask for."""
    wanted: Counter[str] = Counter()
    for container in (pod.get("spec") or {}).get("containers") or []:
        resources = container.get("resources") or {}
        asked = {**(resources.get("requests") or {}), **(resources.get("limits") or {})}
        for name, value in asked.items():
            if (name not in NOT_DEVICES and not name.startswith(("hugepages-", HANDLER_DEVICES))
                    and "/" in name):
                wanted[name] = max(wanted[name], _quantity(value))
    return wanted


def node_ready(node: dict[str, Any]) -> bool:
    conditions = (node.get("status") or {}).get("conditions") or []
    ready = any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)
    return ready and not (node.get("spec") or {}).get("unschedulable")


class NodeAgent:
    """The scheduler, the kubelet and virt-handler for every Node of the API server.

    ``admin`` binds and updates pods and Nodes; ``handler`` authenticates as virt-handler's
    service account and writes VMIs. ``passes`` counts completed passes, so a test can wait
    for "one more full pass" instead of sleeping. ``on_action`` is told each thing it does
    (the demo prints them).
    """

    def __init__(self, admin: client.ApiClient, handler: client.ApiClient, *, interval: float = 0.1,
                 on_action: Callable[[str], None] | None = None) -> None:
        self.on_action = on_action
        self.core = client.CoreV1Api(admin)
        self.vmis = client.CustomObjectsApi(handler)
        self.interval = interval
        self.passes = 0
        self.errors: list[str] = []
        self.history: list[str] = []  # what it did, timestamped: a failing test prints it
        self._stop = threading.Event()
        self._pass_done = threading.Condition()
        self._thread: threading.Thread | None = None

    # --- running ---------------------------------------------------------------------------

    def start(self) -> NodeAgent:
        self._thread = threading.Thread(target=self._loop, name="node-agent", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)

    def __enter__(self) -> NodeAgent:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()

    def wait_passes(self, count: int = 2, timeout: float = 30.0) -> None:
        """Block until ``count`` more full passes have completed (each sees all changes made before)."""
        with self._pass_done:
            target = self.passes + count
            if not self._pass_done.wait_for(lambda: self.passes >= target or self._stop.is_set(), timeout):
                raise AssertionError(f"the node agent made no {count} passes in {timeout}s: {self.errors[-3:]}")

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self.sync()
            except ApiException as exc:  # a race with a controller's own writes: next pass
                self.errors.append(f"{exc.status}: {exc.reason}")
                log.debug("node agent pass failed: %s", exc)
            except Exception as exc:  # keep playing; a test that waits in vain shows the errors
                self.errors.append(repr(exc))
                log.exception("node agent pass failed")
            with self._pass_done:
                self.passes += 1
                self._pass_done.notify_all()
            self._stop.wait(self.interval)

    # --- one pass --------------------------------------------------------------------------

    def sync(self) -> None:
        nodes = self._list(self.core.list_node)
        pods = self._list(self.core.list_pod_for_all_namespaces, label_selector=LAUNCHER_SELECTOR)
        vmis = self.vmis.list_cluster_custom_object(GROUP, VERSION, "virtualmachineinstances")["items"]
        for vmi in vmis:
            self._handle_vmi(vmi)
        for pod in pods:
            self._run_pod(pod, nodes, pods)

    def _list(self, call: Any, **kwargs: Any) -> list[dict[str, Any]]:
        response = call(_preload_content=False, **kwargs)
        items: list[dict[str, Any]] = json.loads(response.data)["items"]
        return items

    # --- virt-handler ------------------------------------------------------------------------

    def _handle_vmi(self, vmi: dict[str, Any]) -> None:
        status = vmi.get("status") or {}
        phase = status.get("phase")
        if vmi["metadata"].get("deletionTimestamp"):
            if phase in ("Scheduled", "Running"):
                self._set_phase(vmi, "Succeeded", "the guest shut down: its VMI is deleted")
        elif phase == "Scheduled":
            self._set_phase(vmi, "Running", f"the domain started on {status.get('nodeName')}")

    def _set_phase(self, vmi: dict[str, Any], phase: str, why: str) -> None:
        """An update of the whole VMI, as virt-handler writes it (its role may update, not patch)."""
        meta, status = vmi["metadata"], dict(vmi.get("status") or {})
        status["phase"] = phase
        status["phaseTransitionTimestamps"] = [
            *(status.get("phaseTransitionTimestamps") or []), {"phase": phase, "phaseTransitionTimestamp": _now()}]
        conditions = [c for c in status.get("conditions") or [] if c.get("type") != "Ready"]
        conditions.append({"type": "Ready", "status": "True" if phase == "Running" else "False",
                           "lastProbeTime": None, "lastTransitionTime": _now()})
        status["conditions"] = conditions
        try:
            self.vmis.replace_namespaced_custom_object(
                GROUP, VERSION, meta["namespace"], "virtualmachineinstances", meta["name"], {**vmi, "status": status})
        except ApiException as exc:
            if exc.status not in (404, 409):  # gone, or changed meanwhile: the next pass sees it
                raise
            return
        self._did(f"VMI {meta['namespace']}/{meta['name']} {phase}: {why}")

    def fail(self, namespace: str, name: str) -> None:
        """The guest crashed: the VMI Failed, its pod's compute container exited with an error."""
        self._end(namespace, name, "Failed")

    def finish(self, namespace: str, name: str) -> None:
        """The guest shut itself down: the VMI Succeeded, its pod completed."""
        self._end(namespace, name, "Succeeded")

    def _end(self, namespace: str, name: str, phase: str) -> None:
        [vmi] = self.vmis.list_namespaced_custom_object(GROUP, VERSION, namespace, "virtualmachineinstances",
                                                        field_selector=f"metadata.name={name}")["items"]
        uid = vmi["metadata"]["uid"]
        self._set_phase(vmi, phase, "on request")
        for pod in self._list(self.core.list_namespaced_pod, namespace=namespace, label_selector=LAUNCHER_SELECTOR):
            if (pod["metadata"].get("labels") or {}).get("kubevirt.io/created-by") == uid:
                self.core.patch_namespaced_pod_status(pod["metadata"]["name"], namespace,
                                                      {"status": {"phase": phase}})

    # --- the scheduler and the kubelet ---------------------------------------------------------

    def _run_pod(self, pod: dict[str, Any], nodes: list[dict[str, Any]], pods: list[dict[str, Any]]) -> None:
        meta, spec, status = pod["metadata"], pod.get("spec") or {}, pod.get("status") or {}
        if meta.get("deletionTimestamp"):
            self._remove(pod)
        elif not spec.get("nodeName"):
            self._schedule(pod, nodes, pods)
        elif status.get("phase", "Pending") == "Pending":
            self._start_containers(pod)

    def _remove(self, pod: dict[str, Any]) -> None:
        meta = pod["metadata"]
        try:
            # The options in the body: the API server reads them there, not in the query, once a body is sent.
            self.core.delete_namespaced_pod(meta["name"], meta["namespace"], body=client.V1DeleteOptions(
                grace_period_seconds=0, preconditions=client.V1Preconditions(uid=meta["uid"])))
        except ApiException as exc:
            if exc.status not in (404, 409):
                raise
            return
        self._did(f"pod {meta['namespace']}/{meta['name']} removed")

    def _schedule(self, pod: dict[str, Any], nodes: list[dict[str, Any]], pods: list[dict[str, Any]]) -> None:
        meta, spec = pod["metadata"], pod.get("spec") or {}
        wanted = devices_requested(pod)
        node = self._fitting_node(wanted, spec.get("nodeSelector") or {}, nodes, pods)
        if node is None:
            self._unschedulable(pod, wanted, len(nodes))
            return
        binding = client.V1Binding(metadata=client.V1ObjectMeta(name=meta["name"]),
                                   target=client.V1ObjectReference(kind="Node", name=node))
        try:
            self.core.create_namespaced_pod_binding(meta["name"], meta["namespace"], binding, _preload_content=False)
        except ApiException as exc:
            if exc.status not in (404, 409):
                raise
            return
        spec["nodeName"] = node  # later pods of this pass count its devices
        self._did(f"pod {meta['namespace']}/{meta['name']} bound to {node}")

    @staticmethod
    def _fitting_node(wanted: Counter[str], selector: dict[str, str], nodes: list[dict[str, Any]],
                      pods: Iterable[dict[str, Any]]) -> str | None:
        held: dict[str, Counter[str]] = {}
        for other in pods:
            bound = (other.get("spec") or {}).get("nodeName")
            if bound and (other.get("status") or {}).get("phase") not in ENDED_PODS:
                held.setdefault(bound, Counter()).update(devices_requested(other))
        for node in sorted(nodes, key=lambda n: n["metadata"]["name"]):
            labels = {**EVERY_NODE_LABELS, **(node["metadata"].get("labels") or {})}
            selected = all(labels.get(k) == v or k.split("/")[0].endswith(NODE_LABELLER_SUFFIX)
                           for k, v in selector.items())
            if not node_ready(node) or not selected:
                continue
            allocatable = (node.get("status") or {}).get("allocatable") or {}
            used = held.get(node["metadata"]["name"], Counter())
            if all(_quantity(allocatable.get(device, 0)) - used[device] >= count for device, count in wanted.items()):
                return str(node["metadata"]["name"])
        return None

    def _unschedulable(self, pod: dict[str, Any], wanted: Counter[str], node_count: int) -> None:
        meta, status = pod["metadata"], pod.get("status") or {}
        if any(c.get("type") == "PodScheduled" and c.get("status") == "False" for c in status.get("conditions") or []):
            return
        missing = ", ".join(sorted(wanted)) or "a node"
        condition = {"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
                     "message": f"0/{node_count} nodes are available: Insufficient {missing}.",
                     "lastProbeTime": None, "lastTransitionTime": _now()}
        self.core.patch_namespaced_pod_status(meta["name"], meta["namespace"],
                                              {"status": {"phase": "Pending", "conditions": [condition]}})
        self._did(f"pod {meta['namespace']}/{meta['name']} unschedulable: {condition['message']}")

    def _start_containers(self, pod: dict[str, Any]) -> None:
        meta, spec = pod["metadata"], pod.get("spec") or {}
        now = _now()
        statuses = [{"name": c["name"], "image": c.get("image", ""), "imageID": "", "ready": True,
                     "restartCount": 0, "started": True, "state": {"running": {"startedAt": now}}}
                    for c in spec.get("containers") or []]
        conditions = [{"type": kind, "status": "True", "lastProbeTime": None, "lastTransitionTime": now}
                      for kind in ("PodScheduled", "Initialized", "ContainersReady", "Ready")]
        self.core.patch_namespaced_pod_status(meta["name"], meta["namespace"], {"status": {
            "phase": "Running", "startTime": now, "conditions": conditions, "containerStatuses": statuses,
            "hostIP": "127.0.0.1", "podIP": "127.0.0.1"}})
        self._did(f"pod {meta['namespace']}/{meta['name']} running on {spec['nodeName']}")

    def _did(self, what: str) -> None:
        self.history.append(f"{datetime.now(UTC).isoformat(timespec='milliseconds')} node agent: {what}")
        log.info("node agent: %s", what)
        if self.on_action is not None:
            self.on_action(what)
