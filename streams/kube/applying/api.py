"""The applier's Kubernetes side: read what a command concerns, once; do what is judged.

    command → :func:`~handlers.rules.judgment.reads` → GETs (or the watched copy) → :class:`~handlers.rules.judgment.Observed`
        → :func:`~handlers.rules.judgment.judge` → a patch, a create, a delete, a PUT to virt-api
        → :class:`Applied`, or :class:`~handlers.rules.results.RetryLater`

Every rule is in handlers/ (handlers/rules/judgment.py, handlers/rules/policy.py); here are the reads,
the writes and the meaning of the API server's answers. A try ends in one of two ways: what
the command came to (:class:`Applied`), or — the object changed under it (409), the server is
busy or away (429, 5xx, no answer) — a :class:`~handlers.rules.results.RetryLater`, after which the
command is read and judged afresh. The loop holds it meanwhile (streams/kube/applying/loop.py).
"""

from __future__ import annotations

import http.client
import json
import logging
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar, assert_never

import urllib3
from kubernetes import client
from kubernetes.client.rest import ApiException

from handlers.contracts.config import LabelKeys
from handlers.contracts.messages import Command
from handlers.rules import judgment
from handlers.rules.enforcement import FIELD_MANAGER  # every write names it: managedFields show vmstream's fields
from handlers.rules.judgment import (
    NAMESPACE,
    NODE,
    VM,
    VMI,
    CancelMark,
    CreateVM,
    DeleteVMI,
    Done,
    Failure,
    Judgment,
    Observed,
    PatchNode,
    PatchVM,
    PutSubresource,
    Refusal,
)
from handlers.rules.results import Outcome, RetryLater, Tries
from handlers.rules.running import already_so
from streams.common import metrics
from streams.kube.informing import PolicyCache, Unknown
from streams.kube.subresources import EVACUATE_CANCEL_PATH, SUBRESOURCE_HEADERS, SUBRESOURCE_PATH

log = logging.getLogger(__name__)

KUBEVIRT = ("kubevirt.io", "v1")
JSON_PATCH = "application/json-patch+json"
MERGE_PATCH = "application/merge-patch+json"
# Commands whose write the API server's admission policy judges against the namespace
# (deploy/base/admission-apply.yaml): only for these may the policy read the namespace from
# its copy. Start, stop and restart go through virt-api, which that policy does not see.
JUDGED_AGAIN_BY_ADMISSION = frozenset({"patch_vm", "create_vm", "delete_vmi"})
# Where each kind is read. As JSON, not as the client's models: building those costs more CPU
# than the rest of a command's checks.
PATHS = {
    NAMESPACE: "/api/v1/namespaces/{name}",
    VM: "/apis/kubevirt.io/v1/namespaces/{namespace}/virtualmachines/{name}",
    VMI: "/apis/kubevirt.io/v1/namespaces/{namespace}/virtualmachineinstances/{name}",
    NODE: "/api/v1/nodes/{name}",
}

T = TypeVar("T")

# Worth another try: the server is busy or away, not saying no.
TRANSIENT_ERRORS: tuple[type[BaseException], ...] = (
    urllib3.exceptions.HTTPError,  # connection refused/reset, timeouts, exhausted retries
    http.client.HTTPException,
    ConnectionError,
    TimeoutError,
)


def is_transient(error: BaseException) -> bool:
    """429 and 5xx, timeouts and connection errors; never another 4xx (that is an answer)."""
    if isinstance(error, ApiException):
        status = int(error.status or 0)
        return status == 429 or status >= 500
    return isinstance(error, TRANSIENT_ERRORS)


def api_message(error: ApiException) -> str:
    """What the API server said: the Status ``message`` when there is one."""
    body = error.body.decode("utf-8", "replace") if isinstance(error.body, bytes) else error.body
    try:
        status = json.loads(body or "")
    except ValueError:
        status = None
    message = status.get("message") if isinstance(status, dict) else None
    if isinstance(message, str) and message:
        return message
    text = (body or "").strip() or str(error.reason or "")
    return f"HTTP {error.status}: {text}" if text else f"HTTP {error.status}"


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    """Backoff for transient failures; after ``attempts`` tries the command fails (never blocks)."""

    attempts: int = 6
    initial_seconds: float = 0.5
    max_seconds: float = 10.0
    connect_timeout: float = 5.0
    read_timeout: float = 30.0

    def later(self, attempt: int, reason: str) -> RetryLater | None:
        """The try after ``attempt`` transient failures met another: when to try again, exponentially
        later and a little at random (appliers that met one outage do not all come back at
        once), or None when the tries are spent."""
        if attempt + 1 >= self.attempts:
            return None
        wait = min(self.initial_seconds * 2 ** attempt, self.max_seconds) + random.uniform(0, self.initial_seconds)
        return RetryLater(wait, reason)


@dataclass(frozen=True, slots=True)
class Applied:
    """What applying one command came to — the input of ``decide_result``."""

    outcome: Outcome
    error: str | None = None
    resource_version: str | None = None
    owner: str | None = None
    refused: bool = False  # by the applier's policy (handlers/rules/policy.py), never sent


def _seen_owner(command: Command, seen: Observed | None) -> str | None:
    """The owner a ``create_vm`` will record, or the one its VM records, as read."""
    if command.type == "create_vm":
        return judgment.owner(command.manifest)
    return judgment.owner(seen.vm) if seen is not None else None


class KubeApplier:
    """Applies one command to the API server; knows nothing of Kafka.

    ``subresource_url`` is where ``subresources.kubevirt.io`` answers: by default the API
    server itself (virt-api is aggregated into it in a real cluster).
    """

    def __init__(
        self,
        api: client.ApiClient,
        *,
        subresource_url: str | None = None,
        retry: RetryPolicy | None = None,
        project_label: str = LabelKeys().project,
        cache: PolicyCache | None = None,
    ) -> None:
        self.api = api
        self.project_label = project_label
        self.cache = cache  # what the policy reads, watched (streams/kube/informing.py); None: read live
        self.custom = client.CustomObjectsApi(api)
        self.core = client.CoreV1Api(api)
        self.subresource_url = subresource_url.rstrip("/") if subresource_url else None
        self.retry = retry or RetryPolicy()

    def apply(self, command: Command) -> Applied:
        """Try ``command`` until it comes to something, waiting as each try asks."""
        tries = Tries()
        while isinstance(outcome := self.try_once(command, tries), RetryLater):
            time.sleep(outcome.after)
            tries = tries.after(outcome)
        return outcome

    def try_once(self, command: Command, tries: Tries = Tries()) -> Applied | RetryLater:
        """One try of ``command`` after ``tries``: read, judge, act. Never raises for what the
        API server answers."""
        seen: Observed | None = None
        try:
            seen = self.observe(command, tries.first)
            return self._act(command, judgment.judge(command, seen, project_label=self.project_label), seen, tries)
        except ApiException as exc:
            if is_transient(exc) and (later := self.retry.later(tries.transients, api_message(exc))) is not None:
                return later
            return Applied("failed", error=api_message(exc), owner=self._owner(command, seen))
        except TRANSIENT_ERRORS as exc:
            error = f"the API server did not answer: {exc}"
            return (self.retry.later(tries.transients, error)
                    or Applied("failed", error=error, owner=self._owner(command, seen)))

    # --- read ------------------------------------------------------------------------------

    def observe(self, command: Command, first: bool = True) -> Observed:
        """The objects ``command`` is judged on, each read once (:func:`~handlers.rules.judgment.reads`)."""
        needs = judgment.reads(command)
        target = command.target
        where = {"namespace": target.namespace, "name": target.name}
        return Observed(
            namespace=self._namespace_labels(command) if NAMESPACE in needs else None,
            vm=self._vm(command, first) if VM in needs else None,
            vmi=self._read(PATHS[VMI].format(**where)) if VMI in needs else None,
            node=self._read(PATHS[NODE].format(**where)) if NODE in needs else None,
        )

    def _namespace_labels(self, command: Command) -> dict[str, str] | None:
        """The target namespace's labels, None when it does not exist.

        From the watched copy when it is current, for the commands whose writes the API
        server's admission policy judges again against the namespace
        (:data:`JUDGED_AGAIN_BY_ADMISSION`); a copy may only let a command through: one it
        would refuse is read live, so a namespace labelled a moment ago is not refused
        (docs/security.md, "Reads from a cache").
        """
        namespace = command.target.namespace or ""
        if self.cache is not None and command.type in JUDGED_AGAIN_BY_ADMISSION:
            cached = self.cache.namespace_labels(namespace)
            if (not isinstance(cached, Unknown)
                    and judgment.namespace_refusal(command, cached, project_label=self.project_label) is None):
                return cached
        found = self._read(PATHS[NAMESPACE].format(name=namespace))
        labels = ((found or {}).get("metadata") or {}).get("labels") or {}
        return {str(key): str(value) for key, value in labels.items()} if found is not None else None

    def _vm(self, command: Command, first: bool) -> dict[str, Any] | None:
        """The VM: for a patch's first try the watched copy when it is the VM the command was
        planned against — the patch is sent under its resourceVersion, so a VM that moved on
        since is a 409, and the next try reads it live. Every other command reads it live: a
        restart's record of itself, say, is written unguarded, and a stale copy without it
        would restart the VM twice."""
        target = command.target
        if self.cache is not None and first and command.type == "patch_vm":
            cached = self.cache.vm(target.namespace or "", target.name, command.base_resource_version)
            if cached is not None:
                return cached
        return self._read(PATHS[VM].format(namespace=target.namespace, name=target.name))

    def _read(self, path: str) -> dict[str, Any] | None:
        """GET ``path`` as JSON; None when it does not exist."""
        try:
            response = self._call(self.api.call_api, path, "GET", header_params={"Accept": "application/json"},
                                  auth_settings=["BearerToken"], _preload_content=False)
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise
        data = response.read()
        response.release_conn()
        found: dict[str, Any] = json.loads(data) or {}
        return found

    def _owner(self, command: Command, seen: Observed | None) -> str | None:
        """The VM's recorded owner, for the failure notice: as read, or else read now — best
        effort, one quick try."""
        if command.type == "create_vm" or (seen is not None and seen.vm is not None):
            return _seen_owner(command, seen)
        target = command.target
        if target.kind not in ("VirtualMachine", "VirtualMachineInstance") or not target.namespace:
            return None
        try:
            vm = self.custom.get_namespaced_custom_object(
                *KUBEVIRT, target.namespace, "virtualmachines", target.name,
                _request_timeout=(self.retry.connect_timeout, self.retry.read_timeout),
            )
        except (ApiException, *TRANSIENT_ERRORS):
            return None
        return judgment.owner(vm)

    # --- act -------------------------------------------------------------------------------

    def _act(self, command: Command, judged: Judgment, seen: Observed, tries: Tries) -> Applied | RetryLater:
        """Do what was judged: one case per judgment (handlers/rules/judgment.py); mypy fails here
        when one has none (``assert_never``)."""
        match judged:
            case RetryLater():
                return judged
            case Done(outcome, rv):
                return Applied(outcome, resource_version=rv, owner=_seen_owner(command, seen))
            case Refusal(reason, owner):
                return Applied("failed", error=f"refused by the applier's policy: {reason}", owner=owner, refused=True)
            case Failure(error):
                return Applied("failed", error=error, owner=self._owner(command, seen))
            case PatchVM():
                return self._conflicts(command, tries.conflicts, seen, lambda: self._patch_vm(judged))
            case CreateVM():
                return self._conflicts(command, tries.conflicts, seen, lambda: self._create_vm(judged))
            case PutSubresource():
                return self._subresource(judged)
            case DeleteVMI():
                return self._delete_vmi(judged)
            case CancelMark():
                return self._cancel_mark(judged)
            case PatchNode():
                return self._patch_node(judged)
            case _:
                assert_never(judged)

    def _conflicts(self, command: Command, conflicts: int, seen: Observed,
                   send: Callable[[], Applied]) -> Applied | RetryLater:
        """``send``, whose 409 means the object is not as judged: judged again on a new read."""
        try:
            return send()
        except ApiException as exc:
            if exc.status != 409:
                raise
        again = judgment.conflicted(command, conflicts)
        if isinstance(again, Failure):
            return Applied("failed", error=again.error, owner=self._owner(command, seen))
        return again

    def _call(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """One API call, counted by how it failed."""
        try:
            return fn(*args, _request_timeout=(self.retry.connect_timeout, self.retry.read_timeout), **kwargs)
        except ApiException as exc:  # by status: a 404 or 409 may be an expected answer
            metrics.API_ERRORS.labels(str(exc.status or "unknown")).inc()
            raise
        except TRANSIENT_ERRORS:
            metrics.API_ERRORS.labels("connection").inc()
            raise

    def _patch_vm(self, action: PatchVM) -> Applied:
        """Send the patch only if the VM is still at the version judged.

        Replacing ``metadata.resourceVersion`` makes it a precondition the API server checks
        (409 Conflict when stale). A ``test`` op would do too, but fails with 422 — the same
        status as a validation error, so a conflict could not be told apart.
        """
        guarded = [{"op": "replace", "path": "/metadata/resourceVersion", "value": action.resource_version},
                   *action.patch]
        patched: dict[str, Any] = self._call(
            self.custom.patch_namespaced_custom_object, *KUBEVIRT, action.namespace, "virtualmachines",
            action.name, guarded, _content_type=JSON_PATCH, field_manager=FIELD_MANAGER,
        )
        return Applied(action.outcome, resource_version=judgment.resource_version(patched))

    def _create_vm(self, action: CreateVM) -> Applied:
        created: dict[str, Any] = self._call(
            self.custom.create_namespaced_custom_object, *KUBEVIRT, action.namespace, "virtualmachines",
            action.manifest, field_manager=FIELD_MANAGER,
        )
        return Applied("applied", resource_version=judgment.resource_version(created))

    def _subresource(self, action: PutSubresource) -> Applied:
        """``PUT …/virtualmachines/{name}/{action}``: virt-api's door, not a CRD path.

        CustomObjectsApi cannot reach it; ``call_api`` with ``_preload_content=False`` can
        (and ``_host`` sends it elsewhere when virt-api is not aggregated). A restart's
        record is written on the VM first. A 409 to a start or stop is ``noop`` when the VMI
        shows the VM already so (handlers/rules/running.py).
        """
        if action.record is not None:
            self._call(self.custom.patch_namespaced_custom_object, *KUBEVIRT, action.namespace, "virtualmachines",
                       action.name, {"metadata": {"annotations": {judgment.RESTART_ANNOTATION: action.record}}},
                       _content_type=MERGE_PATCH, field_manager=FIELD_MANAGER)
        path = SUBRESOURCE_PATH.format(namespace=action.namespace, name=action.name, action=action.action)
        try:
            self._put(path, {})
        except ApiException as exc:
            if exc.status == 409 and action.action != "restart" and already_so(
                    action.action, self._read(PATHS[VMI].format(namespace=action.namespace, name=action.name))):
                return Applied("noop")
            raise
        return Applied("applied")

    def _cancel_mark(self, action: CancelMark) -> Applied:
        """``PUT …/virtualmachineinstances/{name}/evacuate/cancel`` on virt-api
        (``EvacuateCancelHandler``, pkg/virt-api/rest/evacuate_cancel.go): it removes
        ``status.evacuationNodeName`` with a JSON Patch ``test`` on the node named in the
        body, so a mark from another node is never removed."""
        self._put(EVACUATE_CANCEL_PATH.format(namespace=action.namespace, name=action.name),
                  {"evacuationNodeName": action.node})
        return Applied("applied")

    def _put(self, path: str, body: dict[str, Any]) -> None:
        response = self._call(self.api.call_api, path, "PUT", header_params=SUBRESOURCE_HEADERS, body=body,
                              auth_settings=["BearerToken"], _preload_content=False, _host=self.subresource_url)
        response.read()
        response.release_conn()

    def _delete_vmi(self, action: DeleteVMI) -> Applied:
        """Delete the VMI, with its uid as a precondition the API server checks when the
        command names one. Gone already, or another VMI of that name (409): ``noop``."""
        options = client.V1DeleteOptions(preconditions=client.V1Preconditions(uid=action.uid)) if action.uid else None
        try:
            self._call(self.custom.delete_namespaced_custom_object, *KUBEVIRT, action.namespace,
                       "virtualmachineinstances", action.name, body=options)
        except ApiException as exc:
            if exc.status == 404 or (exc.status == 409 and action.uid):
                log.info("VMI %s/%s is gone or no longer %s: not deleted", action.namespace, action.name, action.uid)
                return Applied("noop")
            raise
        return Applied("applied")

    def _patch_node(self, action: PatchNode) -> Applied:
        patched = self._call(self.core.patch_node, action.name, action.body, _content_type=MERGE_PATCH,
                             field_manager=FIELD_MANAGER)
        return Applied("applied", resource_version=patched.metadata.resource_version)
