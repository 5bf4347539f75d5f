"""The applier: commands → the Kubernetes API → command results.

    commands topic → :class:`Command` → already has a result? skip
        → :meth:`KubeApplier.apply` (the API server) → :class:`Applied`
        → :func:`~handlers.results.decide_result` → notifications, audit, command-results
        → commit the command's offset

Commands of different keys (VMs, nodes) are applied at once by a pool of
``apply.concurrency`` workers, those of one key one after the other in offset order
(:class:`Lanes`); what they came to is published, and the offset committed, only for the
prefix of each partition whose commands all have their result.

Level-based (ARCHITECTURE.md, principle 2): a ``patch_vm`` is sent with the observed
``resourceVersion`` as a precondition. When the VM has moved on (another writer, a 409),
the patch is planned again from the live VM with the very functions the worker planned it
with (:func:`~handlers.gpus.desired_vm`, :func:`~handlers.gpus.plan_patch`), so only the
GPU fields are ever touched and nobody else's change is clobbered.

Effectively once: the command-results topic is the ledger. At start-up (and before the
first batch after partitions are assigned, so a rebalance hands over what another applier
did) it is read to the end, and before every other batch what has arrived of it is taken;
a command
whose id already has a result is skipped, with no second effect and no second result. The
result is published last and the offset committed after it, so a crash in between
re-applies a command: the level-based rules make that a ``noop``. A restart cannot be
read off the VM's level (its new VMI may not exist yet), so before the call the applier
records on the VM which command restarts which VMI, and a redelivered restart whose VMI
is gone, going or asked to stop is not sent again.
"""

from __future__ import annotations

import argparse
import http.client
import json
import logging
import math
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any, TypeVar, assert_never

import urllib3
from kubernetes import client
from kubernetes.client.rest import ApiException
from pydantic import ValidationError
from tenacity import Retrying, retry_if_exception, stop_after_attempt, wait_exponential, wait_random

from handlers import policy
from handlers.cluster import OWNER_ANNOTATION
from handlers.config import LabelKeys
from handlers.decisions import subject_key
from handlers.enforcement import FIELD_MANAGER  # every write names it: managedFields show vmstream's fields
from handlers.engine import Engine, Source
from handlers.gpus import GPURuleViolation, desired_vm, plan_patch
from handlers.messages import Command, CommandResult, describe_validation_error
from handlers.results import Outcome, ResultDecision, decide_result
from handlers.running import already_so
from handlers.topics import AUDIT, COMMAND_RESULTS, COMMANDS, NOTIFICATIONS
from streams.common import metrics, spans
from streams.common.cloudevents import TraceBook, event_source, kafka_headers, ref_of
from streams.common.codecs import encode_message
from streams.common.durable import Delivered, DurableProducer, Record
from streams.common.group_reading import GroupReader, Partition, Received
from streams.common.kafka_clients import consumer
from streams.common.probes import ProbeServer, add_probe_arguments
from streams.common.reading import assign_from_start, poll_records, read_to_end
from streams.common.settings import Settings
from streams.common.signing import Keyring, KeyringError, open_sealed
from streams.common.topics import ensure_topics
from streams.kube.informing import UNKNOWN, PolicyCache, Unknown
from streams.kube.subresources import EVACUATE_CANCEL_PATH, SUBRESOURCE_HEADERS, SUBRESOURCE_PATH

if TYPE_CHECKING:
    from confluent_kafka import Consumer
    from pydantic import BaseModel

log = logging.getLogger(__name__)

KUBEVIRT = ("kubevirt.io", "v1")
JSON_PATCH = "application/json-patch+json"
MERGE_PATCH = "application/merge-patch+json"
# On a VM: the restart command last sent for it and the uid of the VMI it restarts, written
# before the call so that the command redelivered after a crash is not sent twice.
RESTART_ANNOTATION = "vmstream.io/restart"
MAX_REPLANS = 5  # a VM that changes under us this often is being fought over: give up, say so
CACHE_SYNC_SECONDS = 60.0  # at start, how long to wait for the policy's cache before reading live
# Commands whose write the API server's admission policy judges against the namespace
# (deploy/base/admission-apply.yaml): only for these may the policy read the namespace from
# its copy. Start, stop and restart go through virt-api, which that policy does not see.
JUDGED_AGAIN_BY_ADMISSION = frozenset({"patch_vm", "create_vm", "delete_vmi"})
QUIET_OUTCOMES = ("applied", "noop")  # logged at DEBUG: most commands, and all on the audit stream
COMMIT_SECONDS = 0.5  # offsets committed at most this often while running: each commit is a request
LEDGER_FETCH_BYTES, LEDGER_FETCH_WAIT_MS = 64 * 1024, 250  # the ledger fetches in batches

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
    """Backoff for transient failures; after ``attempts`` the command fails (never blocks)."""

    attempts: int = 6
    initial_seconds: float = 0.5
    max_seconds: float = 10.0
    connect_timeout: float = 5.0
    read_timeout: float = 30.0

    def retrying(self) -> Retrying:
        return Retrying(
            retry=retry_if_exception(is_transient),
            stop=stop_after_attempt(self.attempts),
            wait=wait_exponential(multiplier=self.initial_seconds, max=self.max_seconds) + wait_random(0, self.initial_seconds),
            reraise=True,
            before_sleep=lambda state: log.warning(
                "transient API error, retrying (attempt %d): %s",
                state.attempt_number,
                state.outcome.exception() if state.outcome else None,
            ),
        )


@dataclass(frozen=True, slots=True)
class Applied:
    """What applying one command came to — the input of ``decide_result``."""

    outcome: Outcome
    error: str | None = None
    resource_version: str | None = None
    owner: str | None = None
    refused: bool = False  # by the applier's policy (handlers/policy.py), never sent


class ApplyError(Exception):
    """The command cannot be applied as it stands: a terminal ``failed``."""

    def __init__(self, message: str, *, owner: str | None = None) -> None:
        super().__init__(message)
        self.owner = owner


class Refused(ApplyError):
    """The applier's policy (handlers/policy.py) does not allow it: nothing was written."""


def _owner(obj: dict[str, Any] | None) -> str | None:
    annotations = ((obj or {}).get("metadata") or {}).get("annotations") or {}
    owner = annotations.get(OWNER_ANNOTATION)
    return owner if isinstance(owner, str) and owner else None


def _rv(obj: dict[str, Any]) -> str | None:
    rv = (obj.get("metadata") or {}).get("resourceVersion")
    return str(rv) if rv is not None else None


def _restart_record(vm: dict[str, Any]) -> dict[str, Any] | None:
    raw = ((vm.get("metadata") or {}).get("annotations") or {}).get(RESTART_ANNOTATION)
    try:
        record = json.loads(raw) if isinstance(raw, str) else None
    except ValueError:
        return None
    return record if isinstance(record, dict) else None


def _where(command: Command) -> tuple[str, str]:
    target = command.target
    if not target.namespace:
        raise ApplyError(f"{command.type} needs a namespaced target, got {target.kind} {target.name}")
    return target.namespace, target.name


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
        """Apply ``command`` if the applier's policy allows it; never raises for what the API
        server answers."""
        try:
            self._check(command)
            return self._dispatch(command)
        except Refused as exc:
            return Applied("failed", error=f"refused by the applier's policy: {exc}", owner=exc.owner, refused=True)
        except ApplyError as exc:
            return Applied("failed", error=str(exc), owner=exc.owner or self._owner_of_target(command))
        except ApiException as exc:
            return Applied("failed", error=api_message(exc), owner=self._owner_of_target(command))
        except TRANSIENT_ERRORS as exc:
            return Applied("failed", error=f"the API server did not answer: {exc}",
                           owner=self._owner_of_target(command))

    def _dispatch(self, command: Command) -> Applied:
        """The change each command type makes: one case per type of ``CommandType``
        (handlers/messages.py); mypy fails here when a type has none (``assert_never``)."""
        match command.type:
            case "patch_vm":
                return self._patch_vm(command)
            case "create_vm":
                return self._create_vm(command)
            case "restart_vm":
                return self._subresource(command, "restart")
            case "start_vm":
                return self._subresource(command, "start")
            case "stop_vm":
                return self._subresource(command, "stop")
            case "delete_vmi":
                return self._delete_vmi(command)
            case "cordon_node":
                return self._set_unschedulable(command, True)
            case "uncordon_node":
                return self._set_unschedulable(command, False)
            case "cancel_evacuation":
                return self._cancel_evacuation(command)
            case _:
                assert_never(command.type)

    # --- policy --------------------------------------------------------------------------

    def _check(self, command: Command) -> None:
        """What the command touches must be vmstream's to touch (handlers/policy.py)."""
        refusal = policy.target_refusal(command)
        if refusal is None and command.target.namespace:
            refusal = self._namespace_refusal(command, command.target.namespace)
        if refusal is None and command.target.kind == "Node":
            try:
                node = self._call(self.core.read_node, command.target.name)
            except ApiException as exc:
                if exc.status == 404:
                    raise ApplyError(f"node {command.target.name} does not exist") from exc
                raise
            refusal = policy.node_refusal(
                command, labels=node.metadata.labels or {}, annotations=node.metadata.annotations or {},
                unschedulable=bool(node.spec and node.spec.unschedulable),
            )
        if refusal is not None:
            raise Refused(refusal)

    def _namespace_refusal(self, command: Command, namespace: str) -> str | None:
        """Is ``namespace`` a project's, and the manifest of a ``create_vm`` its project's?

        Judged on the watched copy of the namespace when it is current, for the commands
        whose writes the API server's admission policy judges again against the namespace
        (:data:`JUDGED_AGAIN_BY_ADMISSION`); a copy may only let a command through: a
        refusal it gives is judged again on the namespace read live, so a namespace labelled
        a moment ago is not refused (docs/security.md, "Reads from a cache").
        """
        if policy.is_system_namespace(namespace):
            return policy.namespace_refusal(namespace, None, project_label=self.project_label)
        cached = (self.cache.namespace_labels(namespace)
                  if self.cache is not None and command.type in JUDGED_AGAIN_BY_ADMISSION else UNKNOWN)
        if not isinstance(cached, Unknown) and self._judge_namespace(command, namespace, cached) is None:
            return None
        return self._judge_namespace(command, namespace, self._namespace_labels(namespace))

    def _judge_namespace(self, command: Command, namespace: str, labels: dict[str, str] | None) -> str | None:
        refusal = policy.namespace_refusal(namespace, labels, project_label=self.project_label)
        if refusal is None and command.type == "create_vm":
            refusal = policy.create_refusal(command, labels or {}, project_label=self.project_label)
        return refusal

    def _namespace_labels(self, namespace: str) -> dict[str, str] | None:
        """The namespace's labels, read live. As JSON, not as a ``V1Namespace``: the client's
        model building costs more CPU than the rest of a command's checks."""
        try:
            response = self._call(self.core.read_namespace, namespace, _preload_content=False)
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise
        data = response.read()
        response.release_conn()
        labels = ((json.loads(data) or {}).get("metadata") or {}).get("labels") or {}
        return {str(key): str(value) for key, value in labels.items()}

    def _check_patch(self, live: dict[str, Any], patch: list[dict[str, Any]]) -> None:
        refusal = policy.patch_refusal(live, patch)
        if refusal is not None:
            raise Refused(refusal, owner=_owner(live))

    # --- calls ---------------------------------------------------------------------------

    def _call(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """One API call, retried with backoff while the failure is transient."""
        timeout = (self.retry.connect_timeout, self.retry.read_timeout)
        for attempt in self.retry.retrying():
            with attempt:
                try:
                    return fn(*args, _request_timeout=timeout, **kwargs)
                except ApiException as exc:  # by status: a 404 or 409 may be an expected answer
                    metrics.API_ERRORS.labels(str(exc.status or "unknown")).inc()
                    raise
                except TRANSIENT_ERRORS:
                    metrics.API_ERRORS.labels("connection").inc()
                    raise
        raise AssertionError("unreachable: tenacity re-raises the last error")

    def _get_vm(self, namespace: str, name: str) -> dict[str, Any]:
        try:
            vm: dict[str, Any] = self._call(
                self.custom.get_namespaced_custom_object, *KUBEVIRT, namespace, "virtualmachines", name
            )
        except ApiException as exc:
            if exc.status == 404:
                raise ApplyError(f"VirtualMachine {namespace}/{name} does not exist") from exc
            raise
        return vm

    def _get_vmi(self, namespace: str, name: str) -> dict[str, Any] | None:
        try:
            vmi: dict[str, Any] = self._call(
                self.custom.get_namespaced_custom_object, *KUBEVIRT, namespace, "virtualmachineinstances", name
            )
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise
        return vmi

    def _owner_of_target(self, command: Command) -> str | None:
        """The VM's recorded owner, for the failure notice; best effort, one quick try."""
        if command.type == "create_vm":
            return _owner(command.manifest)
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
        return _owner(vm)

    # --- patch_vm ------------------------------------------------------------------------

    def _json_patch_vm(self, namespace: str, name: str, patch: list[dict[str, Any]], rv: str | None) -> dict[str, Any]:
        """Send ``patch`` only if the VM is still at ``rv``.

        Replacing ``metadata.resourceVersion`` makes it a precondition the API server checks
        (409 Conflict when stale). A ``test`` op would do too, but fails with 422 — the same
        status as a validation error, so a conflict could not be told apart.
        """
        guarded = [{"op": "replace", "path": "/metadata/resourceVersion", "value": rv}, *patch]
        vm: dict[str, Any] = self._call(
            self.custom.patch_namespaced_custom_object, *KUBEVIRT, namespace, "virtualmachines", name, guarded,
            _content_type=JSON_PATCH, field_manager=FIELD_MANAGER,
        )
        return vm

    def _patch_vm(self, command: Command) -> Applied:
        namespace, name = _where(command)
        # The watched copy when it is the VM the command was planned against: the patch is
        # sent under its resourceVersion, so if the VM moved on since, the answer is a 409
        # and the VM is read live below.
        cached = self.cache.vm(namespace, name, command.base_resource_version) if self.cache is not None else None
        live = cached if cached is not None else self._get_vm(namespace, name)
        owner = _owner(live)
        try:
            if command.patch is not None and _rv(live) == command.base_resource_version:
                if not command.patch:
                    return Applied("noop", resource_version=_rv(live), owner=owner)
                self._check_patch(live, command.patch)
                try:
                    patched = self._json_patch_vm(namespace, name, command.patch, _rv(live))
                    return Applied("applied", resource_version=_rv(patched), owner=owner)
                except ApiException as exc:
                    if exc.status != 409:
                        raise
                    log.info("VM %s/%s changed under command %s: planning again", namespace, name,
                             command.command_id)
                    live = self._get_vm(namespace, name)
            return self._replan(command, namespace, name, live)
        except ApiException as exc:
            raise ApplyError(api_message(exc), owner=owner) from exc

    def _replan(self, command: Command, namespace: str, name: str, live: dict[str, Any]) -> Applied:
        """Plan the command's mutation again from the live VM, as the worker would have."""
        if command.mutation is None:
            raise ApplyError(
                f"VirtualMachine {namespace}/{name} changed since the command was planned "
                f"(resourceVersion {_rv(live)}, planned against {command.base_resource_version}) "
                "and the command carries no mutation to plan again",
                owner=_owner(live),
            )
        for _ in range(MAX_REPLANS):
            owner = _owner(live)
            try:
                desired = desired_vm(live, command.mutation)
            except GPURuleViolation as exc:
                raise ApplyError(str(exc), owner=owner) from exc
            patch = plan_patch(live, desired)
            if not patch:
                return Applied("noop", resource_version=_rv(live), owner=owner)
            self._check_patch(live, patch)
            try:
                patched = self._json_patch_vm(namespace, name, patch, _rv(live))
                return Applied("conflict_retried", resource_version=_rv(patched), owner=owner)
            except ApiException as exc:
                if exc.status != 409:
                    raise ApplyError(api_message(exc), owner=owner) from exc
            live = self._get_vm(namespace, name)
        raise ApplyError(
            f"VirtualMachine {namespace}/{name} kept changing: gave up after {MAX_REPLANS} conflicts",
            owner=_owner(live),
        )

    # --- create_vm -----------------------------------------------------------------------

    def _create_vm(self, command: Command) -> Applied:
        manifest = command.manifest
        if not manifest:
            raise ApplyError("a create_vm command must carry a manifest")
        metadata = manifest.get("metadata") or {}
        namespace = str(metadata.get("namespace") or command.target.namespace or "")
        name = str(metadata.get("name") or command.target.name)
        if not namespace:
            raise ApplyError("a create_vm manifest must name its namespace")
        owner = _owner(manifest)
        try:
            created: dict[str, Any] = self._call(
                self.custom.create_namespaced_custom_object, *KUBEVIRT, namespace, "virtualmachines", manifest,
                field_manager=FIELD_MANAGER,
            )
            return Applied("applied", resource_version=_rv(created), owner=owner)
        except ApiException as exc:
            if exc.status != 409:
                raise ApplyError(api_message(exc), owner=owner) from exc
        existing = self._get_vm(namespace, name)
        if _owner(existing) == owner:
            # Created before — by this very command, replayed, or an earlier one like it.
            return Applied("noop", resource_version=_rv(existing), owner=owner)
        raise ApplyError(
            f"VirtualMachine {namespace}/{name} already exists and was not created for "
            f"{owner or 'this request'}",
            owner=owner,
        )

    # --- restart_vm, start_vm, stop_vm ---------------------------------------------------

    def _subresource(self, command: Command, action: str) -> Applied:
        """``PUT …/virtualmachines/{name}/{action}``: virt-api's door, not a CRD path.

        CustomObjectsApi cannot reach it; ``call_api`` with ``_preload_content=False`` can
        (and ``_host`` sends it elsewhere when virt-api is not aggregated).
        """
        namespace, name = _where(command)
        if action == "restart":
            done = self._restart_done(command, namespace, name)
            if done is not None:
                return done
        path = SUBRESOURCE_PATH.format(namespace=namespace, name=name, action=action)
        try:
            response = self._call(
                self.api.call_api, path, "PUT",
                header_params=SUBRESOURCE_HEADERS,
                body={}, auth_settings=["BearerToken"], _preload_content=False, _host=self.subresource_url,
            )
        except ApiException as exc:
            if exc.status == 409 and self._already_so(namespace, name, action):
                return Applied("noop")
            raise
        response.read()
        response.release_conn()
        return Applied("applied")

    def _restart_done(self, command: Command, namespace: str, name: str) -> Applied | None:
        """Whether this restart was sent already (before a crash); if not, record that it is
        about to be, on the VM, with the uid of the VMI it restarts (:data:`RESTART_ANNOTATION`).

        The command seen again with its record: when that VMI is gone, being deleted, or
        asked to stop (``status.stateChangeRequests``, which virt-api writes before it
        answers), the restart got through — ``applied``, not sent twice. Otherwise the crash
        came between the record and the call: the restart is sent now. No clock is compared:
        a restart whose new VMI does not exist yet is recognised as well as one whose VMI
        was created in the same second as the command.

        Without a record of this command, a VMI created after the command was issued is a
        restart already (``noop``), as before records were kept.
        """
        vm = self._get_vm(namespace, name)
        vmi = self._get_vmi(namespace, name)
        vmi_meta = (vmi or {}).get("metadata") or {}
        uid = vmi_meta.get("uid")
        recorded = _restart_record(vm)
        if recorded is not None and recorded.get("command") == command.command_id:
            before = recorded.get("vmi")
            stopping = any(request.get("action") == "Stop" and request.get("uid") in (None, before)
                           for request in ((vm.get("status") or {}).get("stateChangeRequests") or []))
            if uid != before or vmi_meta.get("deletionTimestamp") or stopping:
                log.info("restart %s of %s/%s was sent before (VMI %s): not again", command.command_id,
                         namespace, name, before)
                return Applied("applied", owner=_owner(vm))
            return None
        created = vmi_meta.get("creationTimestamp")
        if created and datetime.fromisoformat(str(created).replace("Z", "+00:00")) > command.issued_at:
            return Applied("noop")
        if uid:  # without a VMI virt-api refuses (409): nothing to record
            record = json.dumps({"command": command.command_id, "vmi": uid}, separators=(",", ":"))
            self._call(self.custom.patch_namespaced_custom_object, *KUBEVIRT, namespace, "virtualmachines", name,
                       {"metadata": {"annotations": {RESTART_ANNOTATION: record}}}, _content_type=MERGE_PATCH,
                       field_manager=FIELD_MANAGER)
        return None

    def _already_so(self, namespace: str, name: str, action: str) -> bool:
        """After a 409: is the VM already as a start or stop would leave it? The rules judge
        (handlers/running.py); only the VMI is read here."""
        if action not in ("start", "stop"):
            return False
        return already_so(action, self._get_vmi(namespace, name))

    # --- delete_vmi ----------------------------------------------------------------------

    def _delete_vmi(self, command: Command) -> Applied:
        """Delete the VMI — the one of the command's ``target.uid`` only, when it names one (a
        precondition the API server checks): a VMI of that name made since is another VM's."""
        namespace, name = _where(command)
        uid = command.target.uid
        options = client.V1DeleteOptions(preconditions=client.V1Preconditions(uid=uid)) if uid else None
        try:
            self._call(
                self.custom.delete_namespaced_custom_object, *KUBEVIRT, namespace, "virtualmachineinstances", name,
                body=options,
            )
        except ApiException as exc:
            if exc.status == 404:
                return Applied("noop")
            if exc.status == 409 and uid:  # the precondition: that VMI is gone, another has its name
                log.info("VMI %s/%s is no longer %s: not deleted", namespace, name, uid)
                return Applied("noop")
            raise
        return Applied("applied")

    # --- cancel_evacuation ----------------------------------------------------------------

    def _cancel_evacuation(self, command: Command) -> Applied:
        """``PUT …/virtualmachineinstances/{name}/evacuate/cancel`` on virt-api
        (``EvacuateCancelHandler``, pkg/virt-api/rest/evacuate_cancel.go): it removes
        ``status.evacuationNodeName`` with a JSON Patch ``test`` on the node named in the
        body, so a mark from another node is never removed. A VMI gone, or no longer marked
        from that node, is a no-op."""
        namespace, name = _where(command)
        node = command.evacuation_node
        if not node:
            raise ApplyError("a cancel_evacuation command must name the node of the mark (evacuation_node)")
        vmi = self._get_vmi(namespace, name)
        if vmi is None or ((vmi.get("status") or {}).get("evacuationNodeName")) != node:
            return Applied("noop")
        if command.target.uid and (vmi.get("metadata") or {}).get("uid") != command.target.uid:
            return Applied("noop")  # another VMI of that name: its mark is not the one told off
        path = EVACUATE_CANCEL_PATH.format(namespace=namespace, name=name)
        response = self._call(
            self.api.call_api, path, "PUT",
            header_params=SUBRESOURCE_HEADERS,
            body={"evacuationNodeName": node}, auth_settings=["BearerToken"], _preload_content=False,
            _host=self.subresource_url,
        )
        response.read()
        response.release_conn()
        return Applied("applied")

    # --- cordon_node, uncordon_node ------------------------------------------------------

    def _set_unschedulable(self, command: Command, unschedulable: bool) -> Applied:
        name = command.target.name
        try:
            node = self._call(self.core.read_node, name)
        except ApiException as exc:
            if exc.status == 404:
                raise ApplyError(f"node {name} does not exist") from exc
            raise
        if bool(node.spec and node.spec.unschedulable) == unschedulable:
            return Applied("noop", resource_version=node.metadata.resource_version)
        # null removes the field, as a never-cordoned node has none. The annotation says
        # vmstream cordoned it: only such a node is uncordoned (handlers/policy.py).
        body = {
            "metadata": {"annotations": {policy.CORDONED_ANNOTATION: command.command_id if unschedulable else None}},
            "spec": {"unschedulable": True if unschedulable else None},
        }
        patched = self._call(self.core.patch_node, name, body, _content_type=MERGE_PATCH, field_manager=FIELD_MANAGER)
        return Applied("applied", resource_version=patched.metadata.resource_version)


# ------------------------------------------------------------------------------ Kafka side


class ResultLedger:
    """Which commands already have a result, read from the command-results topic itself.

    The topic is the record (no local state to lose): read from the beginning at start-up,
    then read to the end again after a rebalance, and what has arrived taken before every
    other batch, so results another applier published count too.
    Only results sealed by an applier count (streams/common/signing.py), and not those refusing an
    unsealed command: anyone could publish either under a real command's id.
    """

    def __init__(self, settings: Settings, *, keyring: Keyring, timeout: float = 60.0) -> None:

        self.keyring = keyring
        self.ignored = 0  # results that did not count: unsealed, forged, refusing a forgery
        self.topic = settings.kafka.topic(COMMAND_RESULTS)
        self.consumer: Consumer = consumer(
            settings.kafka, client_id=f"{settings.worker.app_id}-applier-ledger",
            group_id=f"{settings.worker.app_id}-applier",
            # Not one fetch per result: the applier's own results it knows already, and what
            # other appliers did matters after a rebalance, which reads to the end anyway.
            config={"fetch.min.bytes": LEDGER_FETCH_BYTES, "fetch.wait.max.ms": LEDGER_FETCH_WAIT_MS},
        )
        self.partitions = assign_from_start(self.consumer, [self.topic], wait=timeout)
        self.done: set[str] = set()
        # partition → offsets of the results this applier wrote there, oldest first, until read back
        self.written: dict[int, deque[int]] = {tp.partition: deque() for tp in self.partitions}

    def __contains__(self, command_id: object) -> bool:
        return command_id in self.done

    def add(self, command_id: str) -> None:
        self.done.add(command_id)

    def wrote(self, delivered: Iterable[Delivered]) -> None:
        """Results this applier wrote, where the broker says it put them. Their commands were
        added to :attr:`done` as they were read (a refusal of an unsealed command marks
        nothing done, sealed or not), so reading them back needs no parse and no MAC check,
        which was a tenth of the loop's own CPU per command. Only the partitions this ledger
        reads, and only offsets the broker reported."""
        for place in delivered:
            mine = self.written.get(place.partition)
            if place.topic == self.topic and place.offset >= 0 and mine is not None:
                mine.append(place.offset)

    def _own(self, record: Received) -> bool:
        """Is ``record`` one this applier wrote? Offsets below it that were never read back
        (compacted away, or skipped) are forgotten on the way: a partition is read in order."""
        mine = self.written.get(record.partition)
        while mine and mine[0] < record.offset:
            mine.popleft()
        if mine and mine[0] == record.offset:
            mine.popleft()
            return True
        return False

    def catch_up(self, timeout: float = 60.0) -> None:
        """Read every result up to the end offsets as they are now."""
        for record in read_to_end(self.consumer, self.partitions, stall=timeout):
            self._read(record)

    def take_arrived(self) -> None:
        """Read the results already fetched, without waiting for more."""
        for record in poll_records(self.consumer, 0):
            self._read(record)

    def _read(self, record: Received) -> None:
        if self._own(record):  # this applier's own: its command is done already
            return
        result, problem = open_sealed(CommandResult, record.value or b"", "command-result", self.keyring)
        if result is None or problem is not None or (result.model_extra or {}).get("refused") == "unauthenticated":
            self.ignored += 1
            if result is not None and problem is not None:
                log.warning("a result for command %s is not sealed by an applier (%s): ignored",
                            result.command_id[:80], problem)
            return
        self.done.add(result.command_id)

    def close(self) -> None:
        self.consumer.close()


def _now() -> datetime:
    return datetime.now(UTC)


# What one command read comes to: messages to publish first (notification, audit record or
# dead letter), then its result.
Outputs = tuple[list[tuple[str, str, "BaseModel"]], list[tuple[str, str, "BaseModel"]]]


class Lanes:
    """Commands read and not yet released: one lane per key, lanes applied at once.

    The commands of one key (one VM, one node: the Kafka key) are applied one after the
    other in the order they were read, by one worker of the pool at a time; commands of
    different keys do not wait for each other. Each partition keeps its commands in offset
    order, and :meth:`release` hands out only the prefix of each that is settled.
    """

    def __init__(self, pool: ThreadPoolExecutor, apply: Callable[[Command], Outputs]) -> None:
        self.pool = pool
        self.apply = apply
        self.changed = threading.Condition()
        self.waiting: dict[str, deque[tuple[list[Any], Command]]] = {}  # key → its lane, the running one first
        self.partitions: dict[Any, deque[list[Any]]] = {}  # partition → [offset, Outputs or None], in offset order
        self.running = 0  # commands started and not settled
        self.unreleased = 0  # commands read and not released: what bounds reading
        self.failure: BaseException | None = None

    def in_flight(self) -> int:
        """Commands read and not released yet, settled or not: a command that takes long
        holds back its partition's later ones, and the reading of more."""
        with self.changed:
            return self.unreleased

    def pending(self) -> bool:
        with self.changed:
            return any(self.partitions.values())

    def settled(self, tp: Any, offset: int, outputs: Outputs) -> None:
        """A command read that needs no API call: released in its turn."""
        with self.changed:
            self.partitions.setdefault(tp, deque()).append([offset, outputs])
            self.unreleased += 1

    def start(self, tp: Any, offset: int, key: str, command: Command) -> None:
        """Apply ``command`` after every command of ``key`` read before it."""
        slot: list[Any] = [offset, None]
        with self.changed:
            self.partitions.setdefault(tp, deque()).append(slot)
            self.running += 1
            self.unreleased += 1
            lane = self.waiting.get(key)
            if lane is not None:  # its key is busy: the lane's worker takes it in turn
                lane.append((slot, command))
                return
            self.waiting[key] = deque([(slot, command)])
        self.pool.submit(self._run_lane, key)

    def _run_lane(self, key: str) -> None:
        while True:
            with self.changed:
                slot, command = self.waiting[key][0]
            try:
                outputs = self.apply(command)
            except BaseException as exc:  # a bug: the loop stops on it, nothing past it is released
                with self.changed:
                    self.failure = exc
                    self.changed.notify_all()
                raise
            with self.changed:
                slot[1] = outputs
                self.running -= 1
                lane = self.waiting[key]
                lane.popleft()
                self.changed.notify_all()
                if not lane:
                    del self.waiting[key]
                    return

    def wait_for_change(self, timeout: float) -> None:
        """Until a command settles, unless one at the head of a partition has already."""
        with self.changed:
            if not any(slots and slots[0][1] is not None for slots in self.partitions.values()):
                self.changed.wait(timeout)

    def wait_until_idle(self) -> None:
        with self.changed:
            while self.running and self.failure is None:
                self.changed.wait()

    def release(self) -> tuple[list[tuple[str, str, BaseModel]], list[tuple[str, str, BaseModel]], dict[Any, int]]:
        """The settled prefix of every partition: its outputs, and the offset to commit."""
        first: list[tuple[str, str, BaseModel]] = []
        results: list[tuple[str, str, BaseModel]] = []
        offsets: dict[Any, int] = {}
        with self.changed:
            if self.failure is not None:
                raise RuntimeError("applying a command failed unexpectedly") from self.failure
            for tp, slots in self.partitions.items():
                while slots and slots[0][1] is not None:
                    offset, (before, result) = slots.popleft()
                    self.unreleased -= 1
                    first.extend(before)
                    results.extend(result)
                    offsets[tp] = offset + 1
        return first, results, offsets


class Applier:
    """The loop: consume commands, apply each once, publish what came of it, commit."""

    def __init__(
        self,
        settings: Settings,
        kube: KubeApplier,
        *,
        group_id: str | None = None,
        clock: Callable[[], datetime] = _now,
        concurrency: int | None = None,
        max_in_flight: int | None = None,
    ) -> None:
        self.settings = settings
        self.concurrency = concurrency or settings.apply.concurrency
        self.max_in_flight = max_in_flight or settings.apply.max_in_flight
        self.kafka = settings.kafka
        self.kube = kube
        self.group_id = group_id or f"{settings.worker.app_id}-applier"
        self.clock = clock
        self.commands_topic = self.kafka.topic(COMMANDS)
        metrics.DEAD_LETTERS.labels(self.commands_topic)  # shown at 0 from the start (the alert's increase())
        self.engine = Engine(settings.rules())  # only for its dead letters
        self.event_source = event_source("applier", settings.worker.app_id)  # CloudEvents ``source``
        self.traces = TraceBook()  # each command's trace, carried by what comes of it (docs/integrators.md)
        self.applied_spans: dict[str, Any] = {}  # command id → its apply span, while spans are on
        self.ready = threading.Event()
        self.uncommitted: dict[Any, int] = {}  # partition → offset past its last released command
        self.unpublished: BaseException | None = None  # why a release failed: nothing is committed after it
        self.committed_at = time.monotonic()
        self.released_at = -math.inf  # when the loop last released (monotonic): the first one is not held
        self.keyring = settings.signing.keyring()
        if not self.keyring or self.keyring.active is None:
            raise KeyringError("the applier needs the signing keys the worker seals commands with, and one to "
                               "seal results with: set signing.keys_file or VMSTREAM_SIGNING__KEYS (docs/security.md)")

    def run(self, stop: threading.Event) -> None:
        """Run until ``stop`` is set; ``ready`` is set once the ledger has been read."""
        ledger = ResultLedger(self.settings, keyring=self.keyring)
        out = DurableProducer(self.kafka, client_id=f"{self.settings.worker.app_id}-applier")
        cache = self.kube.cache
        try:
            if cache is not None:
                cache.start()
            ledger.catch_up()
            if cache is not None and not cache.wait_synced(CACHE_SYNC_SECONDS):
                log.warning("the policy's cache is not listed after %ss: reading live until it is",
                            CACHE_SYNC_SECONDS)
            with ThreadPoolExecutor(self.concurrency, thread_name_prefix="apply") as pool:
                lanes = Lanes(pool, lambda command: self._outputs(command, self.apply_one(command)))
                self._consume(stop, lanes, ledger, out)
        finally:
            out.close()
            ledger.close()
            if cache is not None:
                cache.stop()

    def _consume(self, stop: threading.Event, lanes: Lanes, ledger: ResultLedger, out: DurableProducer) -> None:
        """The loop proper: read commands, set them going, release what they came to."""
        assigned = threading.Event()  # partitions came since the ledger last read to its end
        failed = False  # the loop stopped on an error: nothing is released on the way out

        def settle(revoked: list[Partition]) -> None:
            # A partition taken away mid-flight: what was read of it is finished, published
            # and committed first, so its next owner starts where this one stopped. Called
            # inside commands.poll() and commands.close(), on this thread.
            if not failed:
                self._release(lanes, commands, out, ledger, wait=True)

        commands = GroupReader(
            self.kafka, group_id=self.group_id, client_id=f"{self.settings.worker.app_id}-applier",
            topic=self.commands_topic, on_revoke=settle, on_assign=lambda _: assigned.set(),
            # Static membership and the session: back at once after a crash (settings.py).
            membership=self.settings.worker.librdkafka_membership(),
            fetch_wait_ms=self.settings.apply.fetch_wait_ms,
        )
        log.info("applier ready: %d commands already have a result", len(ledger.done))
        self.ready.set()
        try:
            while not stop.is_set():
                if lanes.in_flight() >= self.max_in_flight:
                    lanes.wait_for_change(timeout=0.5)
                else:
                    # While commands are in flight, back soon to publish what they came to.
                    batch = commands.poll(0.02 if lanes.pending() else 0.5,
                                          max_records=self.max_in_flight - lanes.in_flight())
                    if batch:
                        # Partitions handed over: what their last owner applied is read to the
                        # end first. Otherwise the results that have come are taken as they
                        # are, without a round trip to the broker.
                        if assigned.is_set():
                            assigned.clear()
                            ledger.catch_up()
                        else:
                            ledger.take_arrived()
                        for tp, records in batch.items():
                            for record in records:
                                self._admit(tp, record, ledger, lanes)
                # At the bound, at once: wait_for_change does not wait while a settled command
                # heads a partition, so holding it back would spin the loop.
                if (lanes.in_flight() >= self.max_in_flight
                        or time.monotonic() - self.released_at >= self.settings.apply.release_seconds):
                    self._release(lanes, commands, out, ledger)
                commands.record_lag()
            self._release(lanes, commands, out, ledger, wait=True)
        except BaseException:
            failed = True
            raise
        finally:
            commands.close()  # leaves the group: settle() runs once more, with nothing left

    def _admit(self, tp: Partition, record: Received, ledger: ResultLedger, lanes: Lanes) -> None:
        """One command read: set going behind the commands of its key, or settled at once
        (malformed: a dead letter; not sealed by the worker: refused; already done: skipped)."""
        dead: list[tuple[str, str, BaseModel]] = []
        command = self._parse(record, dead)
        if command is None:
            lanes.settled(tp, record.offset, (dead, []))
            return
        problem = self.keyring.problem("command", command)
        if problem is not None:  # not the worker's: refused, and it marks nothing done
            log.warning("command %s at %s:%d:%d is not sealed by the worker (%s): refused",
                        command.command_id[:80], record.topic, record.partition, record.offset, problem)
            decision = policy.unauthenticated(command, reason=problem, now=self.clock(), topic=self.commands_topic)
            lanes.settled(tp, record.offset, self._outputs(command, decision))
            return
        if command.command_id in ledger:
            log.info("command %s already has a result: skipped", command.command_id)
            lanes.settled(tp, record.offset, ([], []))
            return
        ledger.add(command.command_id)  # a repeat read before this one is done is skipped too
        lanes.start(tp, record.offset, subject_key(command.target), command)

    def _outputs(self, command: Command, decision: ResultDecision) -> Outputs:
        """What to publish of a decision: notification and audit record first, then the result."""
        first: list[tuple[str, str, BaseModel]] = []
        if decision.notification is not None:
            first.append((self.kafka.topic(NOTIFICATIONS), subject_key(decision.notification.subject),
                          decision.notification))
        first.append((self.kafka.topic(AUDIT), decision.audit.input.key or "", decision.audit))
        return first, [(self.kafka.topic(COMMAND_RESULTS), subject_key(command.target), decision.result)]

    def _release(self, lanes: Lanes, commands: GroupReader, out: DurableProducer, ledger: ResultLedger, *,
                 wait: bool = False) -> None:
        """Publish what the commands at the head of each partition came to, and commit past them.

        Only a prefix of each partition is released: a command still in flight holds back
        the ones read after it on its partition (their effects are in the API server, their
        results wait), so the committed offset never passes a command that has no result.
        Notifications and audit records first, the results last: they are what marks a
        command done, for this applier and the next. The offsets are committed once the
        results are acknowledged, at most every :data:`COMMIT_SECONDS`; the loop waits for
        that commit only with ``wait``: when partitions are taken away (the revoke callback)
        and when it stops. A commit not made when the process dies
        or a partition moves only means commands read again: the ledger, read to its end at
        start and after an assignment, skips them.

        The loop releases at most every ``apply.release_seconds`` while commands keep
        settling, and at once when ``max_in_flight`` are unreleased: commands that arrive one
        by one share the two produce requests of a release (tests/kube/test_applier_release.py).

        Once a release could not be published, nothing is released or committed again by
        this process, whoever asks (the loop, or the revoke callback as the consumer
        closes): the commands released with it were taken off their lanes, so a
        later commit would pass them, and they were applied without a result.
        """
        if self.unpublished is not None:
            return
        if wait:
            lanes.wait_until_idle()
        first, results, offsets = lanes.release()
        if first or results:
            self.released_at = time.monotonic()
        try:
            if first:
                self._send(out, first)
            if results:
                ledger.wrote(self._send(out, results))
        except BaseException as error:
            self.unpublished = error
            raise
        self.uncommitted.update(offsets)
        if self.uncommitted and (wait or time.monotonic() - self.committed_at >= COMMIT_SECONDS):
            commands.commit(self.uncommitted, wait=wait)
            self.uncommitted, self.committed_at = {}, time.monotonic()

    def _parse(self, record: Received, dead: list[tuple[str, str, BaseModel]]) -> Command | None:
        key = record.key.decode("utf-8", "replace") if record.key else None
        raw: bytes = record.value or b""
        try:
            command = Command.model_validate_json(raw)
            self.traces.keep(command.command_id, record.headers)
            return command
        except ValidationError as exc:
            self.traces.keep(f"{record.topic}:{record.partition}:{record.offset}", record.headers)
            source = Source(record.topic, key, record.partition, record.offset)
            result = self.engine.dead_letter(raw, describe_validation_error(exc), source, self.clock())
            log.warning("malformed command at %s:%d:%d", record.topic, record.partition, record.offset)
            metrics.DEAD_LETTERS.labels(record.topic).inc()
            dead.extend((self.kafka.topic(o.topic), o.key, o.value) for o in result.outputs())
            return None

    def apply_one(self, command: Command) -> ResultDecision:
        """Apply one command to the API server and decide what to record of it."""
        started = time.perf_counter()
        with spans.span(f"apply {command.type}", self.traces.trace(command.command_id), kind=spans.Kind.CONSUMER,
                        attributes={"vmstream.command": command.command_id,
                                    "vmstream.target": subject_key(command.target)}) as span:
            try:
                applied = self.kube.apply(command)
            except Exception as exc:  # a bug must not stop the line: record it as a failure
                log.exception("applying command %s failed unexpectedly", command.command_id)
                applied = Applied("failed", error=f"internal error: {type(exc).__name__}: {exc}")
            if span is not None:
                span.set_attribute("vmstream.outcome", applied.outcome)
                if applied.outcome == "failed":
                    span.set_status(spans.Status(spans.StatusCode.ERROR, applied.error or "failed"))
                self.applied_spans[command.command_id] = span.get_span_context()
        metrics.APPLY_SECONDS.labels(command.type).observe(time.perf_counter() - started)
        metrics.APPLY_RESULTS.labels(command.type, applied.outcome).inc()
        # The audit stream records every result; a line of its own only for what went otherwise.
        level = logging.DEBUG if applied.outcome in QUIET_OUTCOMES else logging.INFO
        if log.isEnabledFor(level):
            log.log(level, "command %s (%s %s): %s%s", command.command_id, command.type, subject_key(command.target),
                    applied.outcome, f" — {applied.error}" if applied.error else "")
        decision = decide_result(
            command, outcome=applied.outcome, now=self.clock(), error=applied.error,
            resource_version=applied.resource_version, owner=applied.owner, topic=self.commands_topic,
        )
        if applied.refused:
            return ResultDecision(decision.result.model_copy(update={"refused": "policy"}), decision.audit,
                                  decision.notification)
        return decision

    def _send(self, out: DurableProducer, messages: Sequence[tuple[str, str, BaseModel]]) -> list[Delivered]:
        """Send and wait for the broker; each record carries the CloudEvents headers and the
        trace of the command it comes of (streams/common/cloudevents.py). Where each landed."""
        started = spans.now() if spans.enabled() else 0
        delivered = out.send_all([
            Record(topic, key.encode() if key else None, encode_message(value, keyring=self.keyring),
                   list(kafka_headers(value, source=self.event_source, trace=self.traces.trace(ref_of(value)),
                                      time=self.clock()).items()))
            for topic, key, value in messages
        ])
        if started:  # each record's span, a child of its command's apply span (streams/common/spans.py)
            ended = spans.now()
            for topic, _, value in messages:
                ref = ref_of(value)
                spans.sent(value, self.applied_spans.get(ref) or self.traces.trace(ref), topic=topic,
                           start=started, end=ended)
        for _, _, value in messages:
            if isinstance(value, CommandResult):  # the command is done: its trace is not needed again
                self.traces.forget(value.command_id)
                self.applied_spans.pop(value.command_id, None)
        return delivered


# ---------------------------------------------------------------------------------- CLI


def _run(args: argparse.Namespace) -> int:
    from streams.common.startup import check_secrets, load_config, reach_kafka, run_until_signalled
    from streams.kube.kubeconfig import api_client, reach_kubernetes

    logging.getLogger("kafka").setLevel(logging.WARNING)  # kafka-python's connection chatter
    settings = load_config(args)
    check_secrets(settings, seals="results")  # and checks the worker's commands with the same keys
    api = api_client(args.kubeconfig, pool_size=settings.apply.concurrency)
    reach_kubernetes(api.configuration)
    reach_kafka(settings.kafka)
    ensure_topics(settings.kafka)
    with api:
        cache = PolicyCache(api) if settings.apply.cache else None
        applier = Applier(settings, KubeApplier(api, subresource_url=args.subresource_url,
                                                project_label=settings.labels.project, cache=cache))
        return run_until_signalled(
            "apply", applier.run,
            lambda stop: ProbeServer(ready=lambda: applier.ready.is_set() and not stop.is_set(),
                                     host=args.probe_host, port=args.probe_port, process="apply"),
            host=args.probe_host, port=args.probe_port)


def add_parser(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Register ``vmstream apply``."""
    from streams.common.startup import add_kafka_arguments

    apply = commands.add_parser(
        "apply", help="apply the commands topic to the Kubernetes API and publish the results",
        description="Consume commands, apply each to the Kubernetes API once, and publish its "
        "result, audit record and (on failure) a notification.",
    )
    apply.add_argument("--config", help="the configuration file (YAML)")
    apply.add_argument("--kubeconfig", help="kubeconfig file (default: $KUBECONFIG, else in-cluster, "
                       "else ~/.kube/config: streams/kube/kubeconfig.py)")
    apply.add_argument(
        "--subresource-url", metavar="URL",
        help="base URL of KubeVirt's subresource API (start/stop/restart); default: the API "
        "server itself, where virt-api is aggregated",
    )
    add_kafka_arguments(apply)
    add_probe_arguments(apply, 6067)
    apply.set_defaults(handler=_run, process=True)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m streams.kube.applying apply …``, the same as ``vmstream apply …``."""
    from streams.common.dispatch import run_alone

    return run_alone(add_parser, argv)


if __name__ == "__main__":
    sys.exit(main())
