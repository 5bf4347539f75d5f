"""A TEST STAND-IN for virt-api's VM subresources; never shipped.

In a cluster, ``PUT /apis/subresources.kubevirt.io/v1/namespaces/{ns}/virtualmachines/{name}/
{start|stop|restart}`` reaches virt-api through the API server's aggregation layer. The local
control plane has no virt-api, so the applier is pointed (``--subresource-url``) at this
small HTTP server on 127.0.0.1, which does to the REAL API server's objects what virt-api
does (kubevirt/kubevirt ``pkg/virt-api/rest/subresource.go``):

* ``restart``: 409 for Halted and Once, 409 without a VMI; otherwise it asks virt-controller
  (here ``tests/support/kubevirt_sim.py``) to stop the VMI with its uid and start a new one, through
  ``status.stateChangeRequests`` — the new VMI then takes the template as it is now;
* ``start``: 409 when a VMI runs, and for Always and Once; Halted → ``runStrategy: Always``
  (``running: true`` on a legacy VM); Manual / RerunOnFailure → a Start request;
* ``stop``: Always / RerunOnFailure / Once → ``runStrategy: Halted`` (``running: false``);
  Manual → a Stop request for the running VMI; 409 when nothing runs (and for Halted).

Success is 202 with no body; refusals are Kubernetes ``Status`` objects, as virt-api sends.
It authenticates nobody: it listens on loopback for the length of a test.

:meth:`VirtApiStandIn.before_answering` runs a test's hook between a request's effect and
its answer — to kill the caller there, whose call then took effect without its knowing.
"""

from __future__ import annotations

import json
import logging
import re
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import TracebackType
from typing import Any

from kubernetes import client
from kubernetes.client.rest import ApiException

from handlers.cluster import effective_run_strategy

log = logging.getLogger(__name__)

GROUP, VERSION = "kubevirt.io", "v1"
PATH = re.compile(
    r"^/apis/subresources\.kubevirt\.io/v1/namespaces/(?P<namespace>[^/]+)/virtualmachines/"
    r"(?P<name>[^/]+)/(?P<action>start|stop|restart)/?$"
)
ENDED = frozenset({"Succeeded", "Failed"})


class Refusal(Exception):
    """What virt-api answers instead of 202."""

    def __init__(self, code: int, reason: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.reason = reason
        self.message = message


def _conflict(name: str, message: str) -> Refusal:
    return Refusal(409, "Conflict", f'Operation cannot be fulfilled on virtualmachine.kubevirt.io "{name}": {message}')


class VirtApiStandIn:
    """``with VirtApiStandIn(api) as virt_api: … virt_api.url …``"""

    def __init__(self, api: client.ApiClient) -> None:
        self.custom = client.CustomObjectsApi(api)
        self.requests: list[tuple[str, str, str, int]] = []  # (namespace, name, action, code)
        self._outage = 0
        self._hooks: dict[str, Callable[[], None]] = {}
        self._lock = threading.Lock()
        standin = self

        class Handler(BaseHTTPRequestHandler):
            def do_PUT(self) -> None:  # noqa: N802 (http.server's naming)
                length = int(self.headers.get("Content-Length") or 0)
                if length:
                    self.rfile.read(length)
                match = PATH.match(self.path.split("?", 1)[0])
                if match is None:
                    self._answer(404, {"kind": "Status", "apiVersion": "v1", "status": "Failure",
                                       "message": "the server could not find the requested resource",
                                       "reason": "NotFound", "code": 404})
                    return
                code, body = standin.handle(**match.groupdict())
                self._answer(code, body)

            def _answer(self, code: int, body: dict[str, Any] | None) -> None:
                data = json.dumps(body).encode() if body is not None else b""
                try:
                    self.send_response(code)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                except (BrokenPipeError, ConnectionResetError):  # the caller is gone (killed by a test)
                    log.info("virt-api stand-in: the caller left before its answer")

            def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
                log.debug("virt-api stand-in: " + format, *args)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_port}"

    def start(self) -> VirtApiStandIn:
        self._thread = threading.Thread(target=self.server.serve_forever, name="virt-api-standin", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        if self._thread is not None:
            self._thread.join(timeout=10)

    def __enter__(self) -> VirtApiStandIn:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()

    def before_answering(self, action: str, hook: Callable[[], None]) -> None:
        """Call ``hook`` once: after the next successful ``action`` took effect, before the 202."""
        with self._lock:
            self._hooks[action] = hook

    def unavailable(self, times: int) -> None:
        """Answer the next ``times`` requests 503, as the aggregator does while virt-api is away."""
        with self._lock:
            self._outage = times

    # --- what virt-api does ----------------------------------------------------------------

    def handle(self, namespace: str, name: str, action: str) -> tuple[int, dict[str, Any] | None]:
        with self._lock:
            away, self._outage = self._outage > 0, max(0, self._outage - 1)
        if away:
            self.requests.append((namespace, name, action, 503))
            return 503, {"kind": "Status", "apiVersion": "v1", "status": "Failure", "code": 503,
                         "reason": "ServiceUnavailable", "message": "the server is currently unable to handle the request"}
        try:
            getattr(self, f"_{action}")(namespace, name)
            code, body = 202, None
            with self._lock:
                hook = self._hooks.pop(action, None)
            if hook is not None:
                hook()
        except Refusal as refusal:
            code, body = refusal.code, {
                "kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
                "message": refusal.message, "reason": refusal.reason,
                "details": {"name": name, "group": GROUP, "kind": "virtualmachine"}, "code": refusal.code,
            }
        except ApiException as exc:  # what the API server said, passed on as virt-api does
            code = exc.status if exc.status in (404, 409) else 500
            body = {"kind": "Status", "apiVersion": "v1", "status": "Failure", "code": code,
                    "message": f"stand-in: {exc.reason}", "reason": "InternalError" if code == 500 else "Conflict"}
        self.requests.append((namespace, name, action, code))
        log.info("virt-api stand-in: %s %s/%s → %d", action, namespace, name, code)
        return code, body

    def _vm(self, namespace: str, name: str) -> dict[str, Any]:
        try:
            vm: dict[str, Any] = self.custom.get_namespaced_custom_object(
                GROUP, VERSION, namespace, "virtualmachines", name)
        except ApiException as exc:
            if exc.status == 404:
                raise Refusal(404, "NotFound", f'virtualmachine.kubevirt.io "{name}" not found') from exc
            raise
        return vm

    def _vmi(self, namespace: str, name: str) -> dict[str, Any] | None:
        try:
            vmi: dict[str, Any] = self.custom.get_namespaced_custom_object(
                GROUP, VERSION, namespace, "virtualmachineinstances", name)
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise
        return vmi

    def _request(self, vm: dict[str, Any], *changes: dict[str, Any], replace: bool = False) -> None:
        """Ask virt-controller for a stop/start, refusing while another one is underway."""
        meta = vm["metadata"]
        if (vm.get("status") or {}).get("stateChangeRequests") and not replace:
            raise Refusal(500, "InternalError", "unable to complete request: stop/start already underway")
        try:
            self.custom.patch_namespaced_custom_object_status(
                GROUP, VERSION, meta["namespace"], "virtualmachines", meta["name"],
                {"metadata": {"resourceVersion": meta["resourceVersion"]},
                 "status": {"stateChangeRequests": list(changes)}})
        except ApiException as exc:
            if exc.status == 409:
                raise _conflict(meta["name"], "the VM changed; try again") from exc
            raise

    def _set_running(self, vm: dict[str, Any], running: bool) -> None:
        meta = vm["metadata"]
        spec = {"runStrategy": "Always" if running else "Halted"} if "runStrategy" in (vm.get("spec") or {}) \
            else {"running": running}
        self.custom.patch_namespaced_custom_object(
            GROUP, VERSION, meta["namespace"], "virtualmachines", meta["name"], {"spec": spec})

    def _restart(self, namespace: str, name: str) -> None:
        vm = self._vm(namespace, name)
        strategy = effective_run_strategy(vm.get("spec") or {})
        if strategy in ("Halted", "Once"):
            raise _conflict(name, f"RunStategy {strategy} does not support manual restart requests")
        vmi = self._vmi(namespace, name)
        if vmi is None:
            raise _conflict(name, "VM is not running: Halted")
        self._request(vm, {"action": "Stop", "uid": vmi["metadata"]["uid"]}, {"action": "Start"})

    def _start(self, namespace: str, name: str) -> None:
        vm = self._vm(namespace, name)
        vmi = self._vmi(namespace, name)
        phase = ((vmi or {}).get("status") or {}).get("phase")
        if vmi is not None and phase not in ENDED and phase not in (None, "", "Unknown"):
            raise _conflict(name, "VM is already running")
        strategy = effective_run_strategy(vm.get("spec") or {})
        if strategy == "Halted":
            self._set_running(vm, True)
        elif strategy in ("Manual", "RerunOnFailure"):
            if strategy == "RerunOnFailure" and phase == "Failed":
                raise _conflict(name, "RerunOnFailure does not support starting VM from failed state")
            if vmi is not None and phase in ENDED:
                self._request(vm, {"action": "Stop", "uid": vmi["metadata"]["uid"]}, {"action": "Start"})
            else:
                self._request(vm, {"action": "Start"})
        else:
            raise _conflict(name, f"{strategy} does not support manual start requests")

    def _stop(self, namespace: str, name: str) -> None:
        vm = self._vm(namespace, name)
        vmi = self._vmi(namespace, name)
        running = vmi is not None and ((vmi.get("status") or {}).get("phase")) not in ENDED
        strategy = effective_run_strategy(vm.get("spec") or {})
        if strategy == "Halted":
            if not running:
                raise _conflict(name, "VM is not running")
            raise _conflict(name, "Halted only supports manual stop requests with a shorter graceperiod")
        if strategy == "Manual":
            if not running:
                raise _conflict(name, "VM is not running")
            assert vmi is not None
            self._request(vm, {"action": "Stop", "uid": vmi["metadata"]["uid"]}, replace=True)
        else:
            self._set_running(vm, False)
