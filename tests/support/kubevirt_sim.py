"""A TEST TOOL, never shipped: a small lifecycle simulator playing virt-controller's part.

The local control plane is a bare kube-apiserver with KubeVirt's CRDs and no KubeVirt:
nothing turns a VirtualMachine into a VirtualMachineInstance there. Tests that need VMIs
to come and go run :class:`KubeVirtSimulator`, which polls the REAL API server and does,
in a few lines, what virt-controller (and the scheduler) would do:

* run strategies as virt-controller's ``Controller.syncRunStrategy``
  (pkg/virt-controller/watch/vm/vm.go) acts on them, in :func:`run_strategy_action` (the
  table in docs/kubevirt.md): Always starts a VMI whenever there is none and replaces an
  ended one; Once starts one whenever there is none (so a *deleted* VMI is replaced, an
  ended one is not); RerunOnFailure replaces a Failed VMI, deletes a Succeeded one, and
  starts one only when it comes from another strategy (``status.runStrategy``, the strategy
  last acted on, differs); Halted deletes any VMI; Manual acts only on requests. The
  deprecated ``spec.running`` maps onto Always (true) and Halted (false, or unset);
* ``status.stateChangeRequests`` written by virt-api's start/stop/restart (see
  ``tests/support/virt_api_standin.py``): Stop deletes the VMI with the given uid, Start creates one;
* scheduling: a VMI is created from the template (its whole spec: GPUs, CPU model, …) and
  placed on a Ready, schedulable node with a free GPU of its class (``allocatable`` minus
  the GPUs of active VMIs there), or left ``Scheduling`` with ``PodScheduled=False``
  (``Unschedulable``) and placed later, when a card frees up;
* VM status: ``printableStatus`` (Running / Stopped / ErrorUnschedulable), ``created``,
  ``ready``, ``runStrategy`` and the ``RestartRequired`` condition while the template's
  GPUs or CPU model differ from the running VMI's.

VMIs have no status subresource in KubeVirt's CRD (status is written with the object);
VMs have one, so VM status goes through ``/status``.
"""

from __future__ import annotations

import copy
import json
import logging
import threading
from collections import Counter
from collections.abc import Iterable
from datetime import UTC, datetime
from types import TracebackType
from typing import Any

from kubernetes import client
from kubernetes.client.rest import ApiException

from handlers.cluster import effective_run_strategy

log = logging.getLogger(__name__)

GROUP, VERSION = "kubevirt.io", "v1"
ENDED = frozenset({"Succeeded", "Failed"})
UNPLACED = frozenset({"", "Pending", "Scheduling"})
JSON_PATCH = "application/json-patch+json"


def _now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _get(obj: Any, *path: str) -> Any:
    for part in path:
        if not isinstance(obj, dict):
            return None
        obj = obj.get(part)
    return obj


def gpu_devices(domain: Any) -> list[str]:
    gpus = _get(domain, "devices", "gpus") or []
    return sorted(g.get("deviceName", "") for g in gpus if isinstance(g, dict))


def node_schedulable(node: dict[str, Any]) -> bool:
    ready = any(
        c.get("type") == "Ready" and c.get("status") == "True" for c in _get(node, "status", "conditions") or []
    )
    return ready and not _get(node, "spec", "unschedulable")


def vmi_active(vmi: dict[str, Any] | None) -> bool:
    return vmi is not None and _get(vmi, "status", "phase") not in ENDED


def run_strategy_action(strategy: str, vmi_phase: str | None, *, seen: str | None) -> str:
    """What virt-controller does about a VM's VMI when no state change request is pending.

    ``vmi_phase`` is None when the VM has no VMI; ``seen`` is ``status.runStrategy``.
    Returns ``start``, ``stop`` (delete the VMI), ``restart`` (delete it, then start a new
    one) or ``none`` — pkg/virt-controller/watch/vm/vm.go, ``Controller.syncRunStrategy``.
    """
    exists = vmi_phase is not None
    if strategy == "Always":  # "a VMI should always be running"
        if not exists:
            return "start"
        return "restart" if vmi_phase in ENDED else "none"
    if strategy == "RerunOnFailure":
        if exists:
            return {"Failed": "restart", "Succeeded": "stop"}.get(vmi_phase or "", "none")
        return "start" if seen != strategy else "none"  # "when coming here from a different RunStrategy"
    if strategy == "Once":
        return "none" if exists else "start"  # vmi == nil → startVMI, whatever came before
    if strategy == "Halted":
        return "stop" if exists else "none"
    return "none"  # Manual: "VMI's will be started/stopped/restarted using api endpoints only"


class KubeVirtSimulator:
    """Plays virt-controller for the VMs of one namespace, on a background thread.

    Capacity is counted over the VMIs of every namespace (nodes are cluster-wide).
    ``passes`` counts completed reconcile passes, so a test can wait for "one more full
    pass" instead of sleeping.
    """

    def __init__(self, api: client.ApiClient, namespace: str, *, interval: float = 0.1) -> None:
        self.api = api
        self.namespace = namespace
        self.interval = interval
        self.custom = client.CustomObjectsApi(api)
        self.core = client.CoreV1Api(api)
        self.passes = 0
        self.errors: list[str] = []
        self.history: list[str] = []  # what it did, timestamped: a failing test prints it
        self._stop = threading.Event()
        self._pass_done = threading.Condition()
        self._thread: threading.Thread | None = None

    # --- running ---------------------------------------------------------------------------

    def start(self) -> KubeVirtSimulator:
        self._thread = threading.Thread(target=self._loop, name=f"kubevirt-sim-{self.namespace}", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)

    def __enter__(self) -> KubeVirtSimulator:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()

    def wait_passes(self, count: int = 2, timeout: float = 30.0) -> None:
        """Block until ``count`` more full passes have completed (each sees all changes made before)."""
        with self._pass_done:
            target = self.passes + count
            if not self._pass_done.wait_for(lambda: self.passes >= target or self._stop.is_set(), timeout):
                raise AssertionError(f"the simulator made no {count} passes in {timeout}s: {self.errors[-3:]}")

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self.sync()
            except ApiException as exc:  # a race with a test's own writes: next pass
                self.errors.append(f"{exc.status}: {exc.reason}")
                log.debug("simulator pass failed: %s", exc)
            except Exception as exc:  # keep playing; the test sees the errors if it waits in vain
                self.errors.append(repr(exc))
                log.exception("simulator pass failed")
            with self._pass_done:
                self.passes += 1
                self._pass_done.notify_all()
            self._stop.wait(self.interval)

    # --- one pass --------------------------------------------------------------------------

    def sync(self) -> None:
        """One reconcile pass over every VM of the namespace."""
        nodes = json.loads(self.core.list_node(_preload_content=False).data)["items"]
        vmis: list[dict[str, Any]] = self.custom.list_cluster_custom_object(
            GROUP, VERSION, "virtualmachineinstances")["items"]
        vms = self.custom.list_namespaced_custom_object(GROUP, VERSION, self.namespace, "virtualmachines")["items"]
        mine = {v["metadata"]["name"]: v for v in vmis if v["metadata"]["namespace"] == self.namespace}
        for vm in vms:
            name = vm["metadata"]["name"]
            vmi = self._reconcile_vm(vm, mine.get(name), nodes, vmis)
            if vmi is not None and _get(vmi, "status", "phase") in UNPLACED:
                vmi = self._place(vmi, nodes, vmis)
            self._update_vm_status(vm, vmi)

    def _reconcile_vm(self, vm: dict[str, Any], vmi: dict[str, Any] | None, nodes: list[dict[str, Any]],
                      vmis: list[dict[str, Any]]) -> dict[str, Any] | None:
        """What the run strategy and any state change requests make of the VM's VMI."""
        spec = vm.get("spec") or {}
        strategy = effective_run_strategy(spec)
        requests = _get(vm, "status", "stateChangeRequests") or []
        if requests:
            for request in requests:
                if request.get("action") == "Stop" and vmi is not None:
                    if request.get("uid") in (None, vmi["metadata"]["uid"]):
                        self._delete_vmi(vmi, vmis)
                        vmi = None
                elif request.get("action") == "Start" and not vmi_active(vmi):
                    if vmi is not None:
                        self._delete_vmi(vmi, vmis)
                    vmi = self._create_vmi(vm, nodes, vmis)
            self._clear_requests(vm, requests)
            return vmi
        seen = _get(vm, "status", "runStrategy")  # the strategy last acted on: None for a new VM
        phase = None if vmi is None else str(_get(vmi, "status", "phase") or "Pending")
        action = run_strategy_action(strategy, phase, seen=seen)
        if action in ("stop", "restart") and vmi is not None:
            self._delete_vmi(vmi, vmis)
            vmi = None
        if action in ("start", "restart"):
            vmi = self._create_vmi(vm, nodes, vmis)
        return vmi

    # --- VMIs ------------------------------------------------------------------------------

    def _create_vmi(self, vm: dict[str, Any], nodes: list[dict[str, Any]],
                    vmis: list[dict[str, Any]]) -> dict[str, Any]:
        template = _get(vm, "spec", "template") or {}
        metadata = vm["metadata"]
        vmi: dict[str, Any] = {
            "apiVersion": f"{GROUP}/{VERSION}",
            "kind": "VirtualMachineInstance",
            "metadata": {
                "name": metadata["name"],
                "namespace": metadata["namespace"],
                "labels": dict(_get(template, "metadata", "labels") or {}),
                "ownerReferences": [{
                    "apiVersion": f"{GROUP}/{VERSION}", "kind": "VirtualMachine", "name": metadata["name"],
                    "uid": metadata["uid"], "controller": True, "blockOwnerDeletion": True,
                }],
            },
            "spec": copy.deepcopy(template.get("spec") or {"domain": {"devices": {}}}),
            "status": self._placement(template.get("spec") or {}, nodes, vmis),
        }
        created: dict[str, Any] = self.custom.create_namespaced_custom_object(
            GROUP, VERSION, metadata["namespace"], "virtualmachineinstances", vmi)
        vmis.append(created)
        self._did(f"created VMI {metadata['namespace']}/{metadata['name']} "
                  f"({created['status'].get('nodeName') or 'unschedulable'})")
        return created

    def _delete_vmi(self, vmi: dict[str, Any], vmis: list[dict[str, Any]]) -> None:
        meta = vmi["metadata"]
        try:
            self.custom.delete_namespaced_custom_object(
                GROUP, VERSION, meta["namespace"], "virtualmachineinstances", meta["name"],
                body=client.V1DeleteOptions(preconditions=client.V1Preconditions(uid=meta["uid"])))
        except ApiException as exc:
            if exc.status != 404:
                raise
        vmis[:] = [v for v in vmis if v["metadata"]["uid"] != meta["uid"]]
        self._did(f"deleted VMI {meta['namespace']}/{meta['name']}")

    def _place(self, vmi: dict[str, Any], nodes: list[dict[str, Any]],
               vmis: list[dict[str, Any]]) -> dict[str, Any]:
        """Retry scheduling a VMI left unschedulable: a card may have freed up."""
        others = [v for v in vmis if v["metadata"]["uid"] != vmi["metadata"]["uid"]]
        status = self._placement(vmi.get("spec") or {}, nodes, others)
        if not status.get("nodeName"):
            return vmi
        meta = vmi["metadata"]
        patched: dict[str, Any] = self.custom.patch_namespaced_custom_object(
            GROUP, VERSION, meta["namespace"], "virtualmachineinstances", meta["name"],
            [{"op": "replace", "path": "/metadata/resourceVersion", "value": meta["resourceVersion"]},
             {"op": "replace", "path": "/status", "value": status}],
            _content_type=JSON_PATCH)
        vmis[:] = [*others, patched]
        return patched

    @staticmethod
    def _placement(spec: dict[str, Any], nodes: list[dict[str, Any]], vmis: Iterable[dict[str, Any]]) -> dict[str, Any]:
        """The status of a VMI just scheduled: on the first node with room, or nowhere."""
        wanted = Counter(gpu_devices(spec.get("domain")))
        held: dict[str, Counter[str]] = {}
        for vmi in vmis:
            node = _get(vmi, "status", "nodeName")
            if node and vmi_active(vmi):
                held.setdefault(node, Counter()).update(gpu_devices(_get(vmi, "spec", "domain")))
        now = _now()
        for node in sorted(nodes, key=lambda n: n["metadata"]["name"]):
            if not node_schedulable(node):
                continue
            allocatable = _get(node, "status", "allocatable") or {}
            used = held.get(node["metadata"]["name"], Counter())
            if all(int(str(allocatable.get(device, 0))) - used[device] >= count for device, count in wanted.items()):
                return {
                    "phase": "Running",
                    "nodeName": node["metadata"]["name"],
                    "conditions": [
                        {"type": "PodScheduled", "status": "True", "lastTransitionTime": now},
                        {"type": "Ready", "status": "True", "lastTransitionTime": now},
                    ],
                }
        missing = ", ".join(sorted(wanted)) or "a schedulable node"
        return {
            "phase": "Scheduling",
            "conditions": [{
                "type": "PodScheduled", "status": "False", "reason": "Unschedulable",
                "message": f"0/{len(nodes)} nodes are available: Insufficient {missing}",
                "lastTransitionTime": now,
            }],
        }

    def _did(self, what: str) -> None:
        self.history.append(f"{datetime.now(UTC).isoformat(timespec='milliseconds')} sim: {what}")
        log.info("sim: %s", what)

    # --- VM status -------------------------------------------------------------------------

    def _clear_requests(self, vm: dict[str, Any], requests: list[dict[str, Any]]) -> None:
        """Remove the requests handled — only if nobody added one meanwhile (test op)."""
        meta = vm["metadata"]
        try:
            self.custom.patch_namespaced_custom_object_status(
                GROUP, VERSION, meta["namespace"], "virtualmachines", meta["name"],
                [{"op": "test", "path": "/status/stateChangeRequests", "value": requests},
                 {"op": "remove", "path": "/status/stateChangeRequests"}],
                _content_type=JSON_PATCH)
        except ApiException as exc:
            if exc.status != 422:  # 422: the requests changed; the next pass sees the new ones
                raise

    def _update_vm_status(self, vm: dict[str, Any], vmi: dict[str, Any] | None) -> None:
        spec = vm.get("spec") or {}
        status = vm.get("status") or {}
        phase = _get(vmi, "status", "phase")
        active = vmi_active(vmi)
        if not active:
            printable = "Stopped"
        elif phase == "Running":
            printable = "Running"
        else:
            printable = "ErrorUnschedulable"
        conditions = [c for c in status.get("conditions") or [] if c.get("type") != "RestartRequired"]
        if active and self._differs(_get(spec, "template", "spec", "domain"), _get(vmi, "spec", "domain")):
            previous = next((c for c in status.get("conditions") or [] if c.get("type") == "RestartRequired"), None)
            conditions.append(previous or {
                "type": "RestartRequired", "status": "True", "lastTransitionTime": _now(),
                "message": "a non-live-updatable field was changed in the template spec",
            })
        wanted = {
            "printableStatus": printable,
            "created": vmi is not None,
            "ready": phase == "Running",
            "runStrategy": effective_run_strategy(spec),
            "conditions": conditions,
        }
        current = {key: status.get(key) for key in wanted}
        current["created"] = bool(current["created"])
        current["ready"] = bool(current["ready"])
        current["conditions"] = current["conditions"] or []
        if current == wanted:
            return
        meta = vm["metadata"]
        try:
            self.custom.patch_namespaced_custom_object_status(
                GROUP, VERSION, meta["namespace"], "virtualmachines", meta["name"],
                {"metadata": {"resourceVersion": meta["resourceVersion"]}, "status": wanted})
        except ApiException as exc:
            if exc.status not in (404, 409):  # changed meanwhile: the next pass writes it
                raise

    @staticmethod
    def _differs(template: Any, running: Any) -> bool:
        """What KubeVirt cannot change in a running VMI: its GPUs and its CPU model."""
        return (gpu_devices(template) != gpu_devices(running)
                or _get(template, "cpu", "model") != _get(running, "cpu", "model"))
