"""``vmstream api``: the read API for consoles, from the worker's tables, for the whole cluster.

worker changelogs (every partition, ``streams/common/globalview.py``) → :mod:`handlers.reads.views` →
JSON over HTTP, read-only::

    GET /v1/gpu-classes                 the AZ's GPU classes: total / in use / free, permitted
    GET /v1/vms/{namespace}/{name}      a VM's GPU now, after its next restart, what it waits for
    GET /v1/projects/{project}          a project's waiting VMs and the drains that warned it
    GET /v1/plans                       the maintenance plans (a project token: those holding its VMs)
    GET /v1/plans/{plan}                one plan per node, per GPU VM and per owner (a project token: its VMs)
    GET /openapi.json                   this API (docs/schemas/openapi.json), /health, /ready
    GET /metrics                        this process's Prometheus metrics, without a token

No answer depends on which replica is asked: each reads every partition of the changelogs,
not a share of them. Every ``/v1`` page wants ``Authorization: Bearer <token>``: an
operator token sees everything, a project token (``api.project_tokens``, token → project)
sees the GPU classes and its own project only; no token 401, another project's VM 403, a
maintenance plan holding none of its project's VMs 404.

It also keeps the compacted topic ``vmstream.gpu-classes`` (one record per class, keyed by
the class name): each replica reads the topic and publishes a class only when its figures
differ from the topic's latest record, so replicas agree without coordination.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import hmac
import json
import logging
import signal
import time
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any, Protocol

import aiohttp.web
from prometheus_client import Counter, Gauge, Histogram
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from handlers.contracts.config import Config
from handlers.contracts.events import GPU_CLASS_TYPE
from handlers.contracts.messages import GPUClassStatus, vm_key
from handlers.contracts.tracing import ce_headers, derived_trace, parse_traceparent
from handlers.core.catalog import Catalog
from handlers.core.tables import DRAINS, KUBEVIRT, NAMESPACES, PLANS, TRACKING, USAGE, VMIS, VMS, Table
from handlers.reads.plans import PlanList, PlanView, plan_list, plan_view
from handlers.reads.views import (
    GPUClassList,
    ProjectView,
    VMBadge,
    gpu_classes,
    project_of,
    project_view,
    vm_badge,
)
from streams.common import spans
from streams.common.cloudevents import event_source
from streams.common.durable import Delivered, DurableProducer, NotDelivered, Record
from streams.common.globalview import GlobalView
from streams.common.metrics import CONTENT_TYPE, exposition, family
from streams.common.reading import Follower, follow_from_start
from streams.common.settings import ApiSettings, Caller, KafkaSettings
from streams.common.topics import GPU_CLASSES, changelog_topic, ensure_topics

log = logging.getLogger(__name__)

# The worker's tables the answers read, from their changelogs (``Table.stored_as``).
VIEW_TABLES: tuple[Table[Any], ...] = (VMS, VMIS, TRACKING, DRAINS, USAGE, KUBEVIRT, NAMESPACES, PLANS)
PUBLIC = ("/health", "/ready", "/openapi.json", "/metrics")

REQUESTS = family(Counter("vmstream_api_requests_total", "Requests answered, by route and HTTP status",
                          ["route", "status"], registry=None), "api")
REQUEST_SECONDS = family(Histogram("vmstream_api_request_seconds", "Time to answer a request, by route", ["route"],
                                   buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0),
                                   registry=None), "api")
CLASS_RECORDS = family(Counter("vmstream_api_class_records_total", "Records this replica published on "
                               "vmstream.gpu-classes (a class whose figures changed, or a tombstone)",
                               registry=None), "api")
READY = family(Gauge("vmstream_api_ready", "1 once the worker's changelogs and the class topic are read",
                     registry=None), "api")


class Problem(BaseModel):
    """Every error answer."""

    error: str


def caller_of(header: str, tokens: dict[str, Caller]) -> Caller | None:
    """Who a ``Authorization`` header is, comparing it with every token in constant time."""
    given = header.encode()
    found = None
    for token, caller in tokens.items():
        if hmac.compare_digest(given, f"Bearer {token}".encode()):
            found = caller
    return found


class ClassTopic:
    """``vmstream.gpu-classes`` as the topic holds it, and the records to publish so that it
    holds the current figures: a class whose record differs, a tombstone for one gone — each
    with its CloudEvents headers (:func:`class_headers`)."""

    def __init__(self) -> None:
        self.latest: dict[str, bytes] = {}
        self.caught_up = asyncio.Event()

    def apply(self, key: bytes | None, value: bytes | None) -> None:
        if key is None:
            return
        name = key.decode("utf-8", "replace")
        if value is None:
            self.latest.pop(name, None)
        else:
            self.latest[name] = value

    def changes(self, current: list[GPUClassStatus]) -> list[tuple[str, bytes | None]]:
        wanted = {status.name: status.model_dump_json().encode() for status in current}
        changed: list[tuple[str, bytes | None]] = [
            (name, value) for name, value in sorted(wanted.items()) if self.latest.get(name) != value]
        changed += [(name, None) for name in sorted(set(self.latest) - set(wanted))]
        return changed

    async def publish(self, producer: Sender, topic: str, current: list[GPUClassStatus], *,
                      source: str, time: datetime) -> list[str]:
        """Send :meth:`changes` with their headers (:func:`class_headers`), wait for every one, and
        hold them as the topic will read them back; the names of the classes sent."""
        changes = self.changes(current)
        outcomes = await producer.deliver([
            Record(topic, name.encode(), value, class_headers(name, value, source=source, time=time))
            for name, value in changes])
        for (name, value), outcome in zip(changes, outcomes, strict=True):
            if not isinstance(outcome, Delivered):
                raise NotDelivered(f"the class {name} was not written: {outcome}")
            self.apply(name.encode(), value)  # as the topic will read back
        return [name for name, _ in changes]


class Sender(Protocol):
    """What :meth:`ClassTopic.publish` needs of a producer (:class:`DurableProducer`)."""

    async def deliver(self, records: Sequence[Record]) -> list[Delivered | str]: ...


def class_record_id(name: str, value: bytes | None) -> str:
    """A class record's CloudEvents id: ``<name>@<the first 16 hex digits of SHA-256 of its value>``,
    ``<name>@tombstone`` for a tombstone — the same record, the same id, whichever replica sends it."""
    return f"{name}@tombstone" if value is None else f"{name}@{hashlib.sha256(value).hexdigest()[:16]}"


def class_headers(name: str, value: bytes | None, *, source: str, time: datetime) -> list[tuple[str, bytes]]:
    """A class record's CloudEvents (binary mode) headers and ``traceparent``, derived from its id;
    ``time`` when its figures were computed. A tombstone has no value, so no ``content-type``."""
    id_ = class_record_id(name, value)
    headers = ce_headers(id_=id_, type_=GPU_CLASS_TYPE, source=source, time=time, trace=derived_trace(id_))
    return [(header, text.encode("utf-8")) for header, text in headers
            if value is not None or header != "content-type"]


class Api:
    """The views, the class topic and the HTTP pages of one ``vmstream api`` process."""

    def __init__(self, *, kafka: KafkaSettings, app_id: str, rules: Config, conf: ApiSettings) -> None:
        self.kafka = kafka
        self.conf = conf
        self.az = rules.az
        self.catalog = Catalog.from_config(rules)
        self.changelogs = {table: changelog_topic(app_id, table.stored_as) for table in VIEW_TABLES}
        self.view = GlobalView(kafka, self.changelogs, decode=False, client_id=f"{app_id}-api-view")
        self.classes = ClassTopic()
        self.source = event_source("api", app_id)
        self.tokens = conf.tokens()
        self.published = 0

    # ------------------------------------------------------------------ answers

    @property
    def ready(self) -> bool:
        return self.view.caught_up.is_set() and self.classes.caught_up.is_set()

    def gpu_classes(self) -> GPUClassList:
        return gpu_classes(self.view, self.catalog, az=self.az)

    def vm(self, namespace: str, name: str) -> VMBadge | None:
        return vm_badge(self.view, self.catalog, namespace, name)

    def project(self, project: str) -> ProjectView:
        return project_view(self.view, self.catalog, project, tracked=self.view.keys(TRACKING))

    def plans(self, caller: Caller) -> PlanList:
        return plan_list(self.view, project=None if caller.operator else caller.project)

    def plan(self, plan_id: str, caller: Caller) -> PlanView | None:
        return plan_view(self.view, plan_id, project=None if caller.operator else caller.project)

    def project_of_vm(self, namespace: str, name: str) -> str | None:
        """A VM's project: its label, else its namespace's (docs/auth.md)."""
        raw = self.view.get(VMS, vm_key(namespace, name))
        return (raw.project if raw is not None else None) or project_of(self.view, namespace)

    # ------------------------------------------------------------------- Kafka

    async def run_class_topic(self) -> None:
        """Read the class topic (all partitions), then publish what differs, every period."""
        topic = self.kafka.topic(GPU_CLASSES)
        follower = Follower(self.kafka, client_id="vmstream-api")
        producer = DurableProducer(self.kafka, client_id="vmstream-api")
        try:
            async for records in follow_from_start(follower, [topic], self.classes.caught_up,
                                                   poll_ms=int(self.conf.publish_seconds * 1000)):
                for record in records:
                    self.classes.apply(record.key, record.value)
                if self.ready:
                    await self._publish(producer, topic)
        finally:
            await follower.close()
            await asyncio.get_running_loop().run_in_executor(None, producer.close)

    async def _publish(self, producer: Sender, topic: str) -> None:
        computed = datetime.now(UTC)  # the records' ce_time
        changes = await self.classes.publish(producer, topic, self.gpu_classes().classes,
                                             source=self.source, time=computed)
        self.published += len(changes)
        CLASS_RECORDS.inc(len(changes))
        if changes:
            log.info("gpu classes published", extra={"classes": changes})

    # -------------------------------------------------------------------- HTTP

    def web_app(self) -> aiohttp.web.Application:
        app = aiohttp.web.Application(middlewares=[self._count, self._guard])
        app.router.add_get("/health", self._health)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/ready", self._ready)
        app.router.add_get("/openapi.json", self._openapi)
        app.router.add_get("/v1/gpu-classes", self._gpu_classes)
        app.router.add_get("/v1/vms/{namespace}/{name}", self._vm)
        app.router.add_get("/v1/projects/{project}", self._project)
        app.router.add_get("/v1/plans", self._plans)
        app.router.add_get("/v1/plans/{plan}", self._plan)
        return app

    @aiohttp.web.middleware
    async def _count(self, request: aiohttp.web.Request, handler: Any) -> aiohttp.web.StreamResponse:
        """Count every answer by its route (the pattern, never the path: one series per page)."""
        started = time.perf_counter()
        resource = request.match_info.route.resource
        route = resource.canonical if resource is not None else "unknown"
        status = 500
        parent = parse_traceparent(request.headers.get("traceparent"))  # a console's trace, if it sent one
        with spans.span(f"{request.method} {route}", parent, kind=spans.Kind.SERVER,
                        attributes={"http.request.method": request.method, "http.route": route}) as span:
            try:
                answer: aiohttp.web.StreamResponse = await handler(request)
                status = answer.status
                return answer
            except aiohttp.web.HTTPException as error:
                status = error.status
                raise
            finally:
                REQUESTS.labels(route, str(status)).inc()
                REQUEST_SECONDS.labels(route).observe(time.perf_counter() - started)
                if span is not None:
                    span.set_attribute("http.response.status_code", status)

    @aiohttp.web.middleware
    async def _guard(self, request: aiohttp.web.Request, handler: Any) -> aiohttp.web.StreamResponse:
        if request.path in PUBLIC:
            public: aiohttp.web.StreamResponse = await handler(request)
            return public
        caller = caller_of(request.headers.get("Authorization", ""), self.tokens)
        if caller is None:
            return _problem(401, "a bearer token is required",
                            headers={"WWW-Authenticate": 'Bearer realm="vmstream"'})
        if not self.ready:
            return _problem(503, "the tables are not read yet")
        request["caller"] = caller
        answer: aiohttp.web.StreamResponse = await handler(request)
        return answer

    async def _health(self, request: aiohttp.web.Request) -> aiohttp.web.Response:
        return aiohttp.web.json_response({"status": "ok"})

    async def _ready(self, request: aiohttp.web.Request) -> aiohttp.web.Response:
        body = {"ready": self.ready, "tables": self.view.caught_up.is_set(),
                "gpu_classes_topic": self.classes.caught_up.is_set()}
        return aiohttp.web.json_response(body, status=200 if self.ready else 503)

    async def _metrics(self, request: aiohttp.web.Request) -> aiohttp.web.Response:
        READY.set(1 if self.ready else 0)
        return aiohttp.web.Response(body=exposition("api"), content_type=CONTENT_TYPE)

    async def _openapi(self, request: aiohttp.web.Request) -> aiohttp.web.Response:
        return aiohttp.web.json_response(openapi_document())

    async def _gpu_classes(self, request: aiohttp.web.Request) -> aiohttp.web.Response:
        return _answer(self.gpu_classes())

    async def _vm(self, request: aiohttp.web.Request) -> aiohttp.web.Response:
        caller: Caller = request["caller"]
        namespace, name = request.match_info["namespace"], request.match_info["name"]
        if not caller.operator and self.project_of_vm(namespace, name) != caller.project:
            return _problem(403, f"VM {namespace}/{name} is not of project {caller.project}")
        badge = self.vm(namespace, name)
        if badge is None:
            return _problem(404, f"VM {namespace}/{name} is unknown")
        return _answer(badge)

    async def _project(self, request: aiohttp.web.Request) -> aiohttp.web.Response:
        caller: Caller = request["caller"]
        project = request.match_info["project"]
        if not caller.operator and project != caller.project:
            return _problem(403, f"this token is for project {caller.project}, not {project}")
        return _answer(self.project(project))

    async def _plans(self, request: aiohttp.web.Request) -> aiohttp.web.Response:
        return _answer(self.plans(request["caller"]))

    async def _plan(self, request: aiohttp.web.Request) -> aiohttp.web.Response:
        plan_id = request.match_info["plan"]
        plan = self.plan(plan_id, request["caller"])
        if plan is None:  # a project token: also a plan that holds none of its VMs
            return _problem(404, f"maintenance plan {plan_id} is unknown")
        return _answer(plan)


def _answer(model: BaseModel) -> aiohttp.web.Response:
    return aiohttp.web.Response(body=model.model_dump_json().encode(), content_type="application/json")


def _problem(status: int, error: str, headers: dict[str, str] | None = None) -> aiohttp.web.Response:
    return aiohttp.web.Response(status=status, body=Problem(error=error).model_dump_json().encode(),
                                content_type="application/json", headers=headers)


# ------------------------------------------------------------------------- OpenAPI

_RESPONSES: dict[str, tuple[str, str, type[BaseModel], str, tuple[str, ...], str | None]] = {
    # path → (operation id, summary, response model, description, path parameters, what a 404 means)
    "/v1/gpu-classes": ("listGpuClasses", "The AZ's GPU classes with their cards", GPUClassList,
                        "Every configured class, plus devices seen on nodes that no class names. Any token.", (),
                        None),
    "/v1/vms/{namespace}/{name}": (
        "getVmBadge", "A VM's GPU now and after its next restart", VMBadge,
        "`waits_for: restart` is the console's \"(applies after restart)\". An operator token, or the "
        "token of the VM's project (its label, else its namespace's).", ("namespace", "name"),
        "No such VM observed"),
    "/v1/projects/{project}": (
        "getProject", "A project's waiting VMs and announced drains", ProjectView,
        "An operator token, or this project's token.", ("project",), None),
    "/v1/plans": (
        "listPlans", "The maintenance plans", PlanList,
        "An operator token: every plan, counted over all its nodes and GPU VMs. A project token: the plans "
        "that hold one of its project's GPU VMs, counted over those VMs and their nodes.", (), None),
    "/v1/plans/{plan}": (
        "getPlan", "One maintenance plan per node, per GPU VM and per owner", PlanView,
        "Each node's slot and phase; each GPU VM's stop, fate, return and reason; what each owner is told. "
        "An operator token sees every VM; a project token only its project's VMs (its label, else its "
        "namespace's), their nodes and owners.", ("plan",),
        "No such plan, or (a project token) a plan holding none of its project's VMs"),
}


def openapi_document() -> dict[str, Any]:
    """The OpenAPI 3.1 document of the read API, its schemas generated from the models."""
    models: list[type[BaseModel]] = [GPUClassList, VMBadge, ProjectView, PlanList, PlanView, Problem]
    _, top = models_json_schema([(m, "serialization") for m in models], ref_template="#/components/schemas/{model}")
    defs = top.get("$defs", {})
    problem = {"description": "", "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Problem"}}}}
    paths: dict[str, Any] = {}
    for path, (op_id, summary, model, description, params, not_found) in _RESPONSES.items():
        paths[path] = {"get": {
            "operationId": op_id,
            "summary": summary,
            "description": description,
            "parameters": [{"name": p, "in": "path", "required": True, "schema": {"type": "string"}} for p in params],
            "responses": {
                "200": {"description": "The answer, the same from every replica",
                        "content": {"application/json": {"schema": {"$ref": f"#/components/schemas/{model.__name__}"}}}},
                "401": {**problem, "description": "No valid bearer token"},
                "403": {**problem, "description": "The token's project may not see this"},
                **({"404": {**problem, "description": not_found}} if not_found else {}),
                "503": {**problem, "description": "The tables are not read yet"},
            },
        }}
    return {
        "openapi": "3.1.0",
        "info": {"title": "vmstream read API", "version": "1.0.0",
                 "description": "What a console shows of GPU VMs, read-only, the same from every replica "
                                "(docs/api.md)."},
        "servers": [{"url": "http://127.0.0.1:6069", "description": "`vmstream api`'s default address"}],
        "security": [{"bearer": []}],
        "paths": paths,
        "components": {
            "schemas": {name: defs[name] for name in sorted(defs)},
            "securitySchemes": {"bearer": {
                "type": "http", "scheme": "bearer",
                "description": "An operator token (api.operator_token) or a project token (api.project_tokens)."}},
        },
    }


# ---------------------------------------------------------------------- command


async def serve(api: Api, host: str, port: int) -> None:
    runner = aiohttp.web.AppRunner(api.web_app(), access_log=None)
    await runner.setup()
    site = aiohttp.web.TCPSite(runner, host, port)
    try:
        await site.start()
    except OSError as error:  # taken since main() checked it
        from streams.common.startup import cannot_listen

        await runner.cleanup()
        raise cannot_listen(host, port, "api.port (VMSTREAM_API__PORT)", error) from error
    log.info("api listening", extra={"host": host, "port": port})
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    tasks = [asyncio.ensure_future(api.view.run()), asyncio.ensure_future(api.run_class_topic())]
    stopped = asyncio.ensure_future(stop.wait())
    try:
        done, _ = await asyncio.wait([*tasks, stopped], return_when=asyncio.FIRST_COMPLETED)
        for task in done:
            if task is not stopped:
                task.result()  # a reader that died stops the process
    finally:
        for task in [*tasks, stopped]:
            task.cancel()
        await asyncio.gather(*tasks, stopped, return_exceptions=True)
        await runner.cleanup()


def main(args: argparse.Namespace) -> int:
    """``vmstream api``: check the port and the broker, then serve until SIGINT or SIGTERM."""
    from streams.common.errors import EXIT_OK
    from streams.common.startup import check_port, check_secrets, load_config, reach_kafka

    settings = load_config(args)
    check_secrets(settings, api_tokens=True)
    check_port(settings.api.host, settings.api.port, "api.port (VMSTREAM_API__PORT)")
    reach_kafka(settings.kafka)
    api = Api(kafka=settings.kafka, app_id=settings.worker.app_id, rules=settings.rules(), conf=settings.api)
    # The changelogs may not exist yet (no worker started): created as the worker creates them.
    ensure_topics(settings.kafka, changelogs=tuple(api.changelogs.values()))
    asyncio.run(serve(api, settings.api.host, settings.api.port))
    return EXIT_OK


def openapi_text() -> str:
    return json.dumps(openapi_document(), indent=2, ensure_ascii=False) + "\n"
