"""What the applier's policy reads, kept in memory by a list and a watch: an informer.

    API server ──list, then watch (bookmarks)──► :class:`Informer` ──get──► the applier

Before each patch the applier used to make two reads for its policy — the namespace's
labels and the live VM — so it sent three requests where a plain client sends one. An
informer (controller-runtime's, in small) lists a resource once, then follows a watch from
the list's ``resourceVersion``, relisting when the API server answers ``410 Gone``; the
applier reads the copy. It is trusted only when it is *current* (:meth:`Informer.current`):
listed, its watch open, and that watch (re)opened within :data:`WATCH_SECONDS` +
:data:`READ_GRACE_SECONDS` — each watch lasts :data:`WATCH_SECONDS` on the server, and one opened from a resourceVersion gets
every change after it at once, so a connection that died silently is noticed within
seconds, not minutes. A cache that is not current is not read: the applier reads live.

How the applier stays as safe with a copy that may lag is in docs/security.md ("Reads
from a cache"): a VM from the cache is patched only under its ``resourceVersion`` (a stale
copy is a 409, and the VM is read again live); a namespace's labels from the cache may
only let a command through, never refuse one (a refusal is read again live); the API
server's admission policy judges every write against the live namespace.

Objects are read raw (``_preload_content=False``) and kept as the JSON text they came in
(a watch event's line as it is: writing it again would cost more than reading it): every
:meth:`Informer.get` parses a fresh copy, so nobody can change the cache by changing what
it was given, and 10,000 VMs take a few tens of MiB.
"""

from __future__ import annotations

import json
import logging
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kubernetes import client
from kubernetes.client.rest import ApiException
from kubernetes.watch.watch import iter_resp_lines

if TYPE_CHECKING:
    from urllib3 import BaseHTTPResponse

log = logging.getLogger(__name__)

LIST_PAGE = 500
WATCH_SECONDS = 10  # one watch request's lifetime on the server: then it is opened again
CONNECT_SECONDS = 5.0
READ_GRACE_SECONDS = 5.0  # a watch silent this long past its lifetime is a dead connection
BACKOFF_FIRST, BACKOFF_CAP = 0.5, 30.0
# Namespaces: only their metadata (the labels are what the policy reads).
METADATA_ONLY = "application/json;as=PartialObjectMetadataList;g=meta.k8s.io;v=v1"
METADATA_ONLY_WATCH = "application/json;as=PartialObjectMetadata;g=meta.k8s.io;v=v1"


class Gone(Exception):
    """The resourceVersion the watch resumes from is too old (410): list again."""


@dataclass(frozen=True, slots=True)
class Resource:
    """A cluster-wide collection: its path, and whether only its objects' metadata is kept."""

    name: str  # for logs and metrics
    path: str  # /api/v1/namespaces, /apis/kubevirt.io/v1/virtualmachines
    metadata_only: bool = False


NAMESPACES = Resource("namespaces", "/api/v1/namespaces", metadata_only=True)
VIRTUAL_MACHINES = Resource("virtualmachines", "/apis/kubevirt.io/v1/virtualmachines")


def _key(obj: dict[str, Any]) -> str:
    metadata = obj.get("metadata") or {}
    namespace = metadata.get("namespace")
    return f"{namespace}/{metadata.get('name')}" if namespace else str(metadata.get("name"))


# An object as kept: its JSON text, and whether that text is a watch event holding it.
Kept = tuple[str, bool]


class Informer:
    """One resource, listed then watched by a thread of its own; :meth:`get` reads the copy."""

    def __init__(self, api: client.ApiClient, resource: Resource, *, watch_seconds: int = WATCH_SECONDS,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.api = api
        self.resource = resource
        self.watch_seconds = watch_seconds
        self.clock = clock
        self.synced = threading.Event()  # the first list is in
        self.objects: dict[str, Kept] = {}
        self.resource_version: str | None = None
        self.opened_at: float | None = None  # when the open watch was opened; None: no watch open
        self.lists = 0  # lists made: the first, and one after each 410
        self._lock = threading.Lock()
        self._response: BaseHTTPResponse | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"informer-{resource.name}", daemon=True)

    # --- what the applier asks -----------------------------------------------------------

    def current(self) -> bool:
        """Listed, its watch open, and opened recently enough that the copy cannot lag by
        more than a watch's lifetime (module docstring)."""
        with self._lock:
            opened = self.opened_at
        return (self.synced.is_set() and opened is not None
                and self.clock() - opened <= self.watch_seconds + READ_GRACE_SECONDS)

    def get(self, key: str) -> dict[str, Any] | None:
        """A fresh copy of the object named ``key`` (``namespace/name``, or ``name`` for a
        cluster-scoped one), or None when the copy has none. Ask :meth:`current` first."""
        kept = self.objects.get(key)
        if kept is None:
            return None
        text, is_event = kept
        obj: dict[str, Any] = json.loads(text)
        return obj["object"] if is_event else obj

    # --- running -------------------------------------------------------------------------

    def start(self) -> Informer:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        with self._lock:
            response = self._response
        if response is not None:
            try:
                response.shutdown()  # a blocked read returns (urllib3 >= 2.3)
            except Exception as error:  # already closed
                log.debug("informer %s: %s", self.resource.name, error)
        self._thread.join(timeout=10)

    def _run(self) -> None:
        failures = 0
        while not self._stop.is_set():
            try:
                if self.resource_version is None:
                    self._list()
                self._watch()
                failures = 0
            except Gone as error:
                log.info("informer %s: %s; listing again", self.resource.name, error)
                self.resource_version = None
            except Exception as error:  # the API server away, 403, a broken stream: retried, never fatal
                if self._stop.is_set():
                    return
                failures += 1
                wait = random.uniform(0, min(BACKOFF_CAP, BACKOFF_FIRST * 2 ** failures))
                log.warning("informer %s failed (attempt %d): %s: %s; the applier reads live meanwhile, "
                            "retrying in %.1fs", self.resource.name, failures, type(error).__name__,
                            str(error)[:300], wait)
                self._stop.wait(wait)
            finally:
                with self._lock:
                    self.opened_at = None
                    self._response = None

    def _request(self, params: dict[str, Any], accept: str, timeout: float) -> BaseHTTPResponse:
        try:
            response: BaseHTTPResponse = self.api.call_api(
                self.resource.path, "GET", query_params=list(params.items()),
                header_params={"Accept": accept}, auth_settings=["BearerToken"],
                _preload_content=False, _request_timeout=(CONNECT_SECONDS, timeout),
            )
        except ApiException as error:
            if error.status == 410:
                raise Gone(f"410 {error.reason}") from error
            raise
        return response

    def _list(self) -> None:
        """Every object, page by page (one consistent snapshot), replacing the copy."""
        accept = METADATA_ONLY if self.resource.metadata_only else "application/json"
        listed: dict[str, Kept] = {}
        token: str | None = None
        while True:
            params: dict[str, Any] = {"limit": LIST_PAGE}
            if token:
                params["continue"] = token
            response = self._request(params, accept, 120.0)
            try:
                page = json.loads(response.data)
            finally:
                response.release_conn()
            for item in page.get("items") or []:
                (item.get("metadata") or {}).pop("managedFields", None)
                listed[_key(item)] = (json.dumps(item, separators=(",", ":")), False)
            token = (page.get("metadata") or {}).get("continue")
            if not token:
                break
        self.objects = listed
        self.resource_version = str(page["metadata"]["resourceVersion"])
        self.lists += 1
        if not self.synced.is_set():
            log.info("informer %s: %d listed at resourceVersion %s", self.resource.name, len(listed),
                     self.resource_version)
        self.synced.set()

    def _watch(self) -> None:
        """One watch request, from :attr:`resource_version`, until the server ends it."""
        accept = METADATA_ONLY_WATCH if self.resource.metadata_only else "application/json"
        params = {"watch": "true", "resourceVersion": self.resource_version, "allowWatchBookmarks": "true",
                  "timeoutSeconds": str(self.watch_seconds)}
        response = self._request(params, accept, self.watch_seconds + READ_GRACE_SECONDS)
        with self._lock:
            self._response = response
            self.opened_at = self.clock()
        try:
            for line in iter_resp_lines(response):
                if self._stop.is_set():
                    return
                if line:
                    self._event(line)
        finally:
            response.release_conn()

    def _event(self, line: str) -> None:
        event = json.loads(line)
        kind, obj = event.get("type"), event.get("object") or {}
        if kind == "ERROR":
            if obj.get("code") == 410:
                raise Gone(str(obj.get("message") or "410 Gone"))
            raise RuntimeError(f"watch error {obj.get('code')}: {obj.get('message')}")
        rv = (obj.get("metadata") or {}).get("resourceVersion")
        if kind in ("ADDED", "MODIFIED"):
            self.objects[_key(obj)] = (line, True)
        elif kind == "DELETED":
            self.objects.pop(_key(obj), None)
        if rv:
            self.resource_version = str(rv)


class Unknown:
    """The copy cannot say (not listed yet, or its watch is not current): read live."""


UNKNOWN = Unknown()


class PolicyCache:
    """The two informers the applier's policy reads: namespaces (their labels) and VMs.

    Its own client, so its two long-lived watches never take a connection the applier's
    calls would otherwise reuse.
    """

    def __init__(self, api: client.ApiClient, *, watch_seconds: int = WATCH_SECONDS) -> None:
        self.api = client.ApiClient(api.configuration)
        self.namespaces = Informer(self.api, NAMESPACES, watch_seconds=watch_seconds)
        self.vms = Informer(self.api, VIRTUAL_MACHINES, watch_seconds=watch_seconds)

    def start(self) -> PolicyCache:
        self.namespaces.start()
        self.vms.start()
        return self

    def wait_synced(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        return all(informer.synced.wait(max(0.0, deadline - time.monotonic()))
                   for informer in (self.namespaces, self.vms))

    def stop(self) -> None:
        self.namespaces.stop()
        self.vms.stop()
        self.api.close()

    def namespace_labels(self, name: str) -> dict[str, str] | None | Unknown:
        """The namespace's labels, None when it does not exist, :data:`UNKNOWN` when the copy
        is not current."""
        if not self.namespaces.current():
            return UNKNOWN
        namespace = self.namespaces.get(name)
        if namespace is None:
            return None
        labels = (namespace.get("metadata") or {}).get("labels") or {}
        return {str(key): str(value) for key, value in labels.items()}

    def vm(self, namespace: str, name: str, resource_version: str | None) -> dict[str, Any] | None:
        """A copy of the VM if the copy is at ``resource_version`` (the one the command was
        planned against), else None. Not required to be current: whatever is done with it
        is sent under its resourceVersion, so a stale copy costs a 409, never a wrong write."""
        if resource_version is None or not self.vms.synced.is_set():
            return None
        vm = self.vms.get(f"{namespace}/{name}")
        if vm is None or str((vm.get("metadata") or {}).get("resourceVersion")) != resource_version:
            return None
        return vm
