"""``vmstream api`` on a real broker over a real worker: any replica, the same answer.

A worker decides the AZ's events and a ``set_gpu``; two ``vmstream api`` processes read its
changelogs. Both must answer what ``simulate`` decides over the same inputs (one process,
state in memory) — a forged audit record beside the real one changes nothing — token
scoping must hold, and ``vmstream.gpu-classes`` must hold one current record per class —
read back by the test's own consumer.
"""

from __future__ import annotations

import hashlib
import json
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from handlers.contracts.tracing import derived_trace
from handlers.decide.engine import Engine
from handlers.reads.views import gpu_classes, vm_badge
from harness.running import CONFIG, Deployment, Outputs, VmstreamProcess, WorkerProcess, capacity_after
from harness.scenarios import BOB, Script, cluster
from samples.cluster import RTX, vm
from streams.common.settings import load_settings
from streams.cli.simulating import Simulation
from streams.common.topics import GPU_CLASSES
from tests.support.kafka_io import TopicReader

pytestmark = pytest.mark.kafka

OPERATOR = "operator-token-1"
PROJECT_TOKENS = {"proj-a-token": "proj-a", "proj-b-token": "proj-b"}


def scenario() -> tuple[list[str], list[str]]:
    """The AZ, then bob's set_gpu on his running dev-1; then the patched VM as the watch sees it."""
    first = cluster().wait(60)
    first.intent("it-api-gpu-1", "set_gpu", {"namespace": "spx-proj-b", "name": "dev-1",
                                             "gpu_class": "nvidia-rtx-pro-6000-bse"}, by=BOB, project="proj-b")
    patched = Script(first.now, "ev-api")
    patched.event("MODIFIED", vm("spx-proj-b", "dev-1", project="proj-b", memory="32Gi", gpu=RTX, rv=2))
    return list(first.jsonl()), list(patched.jsonl())


def simulated(lines: list[str]) -> tuple[dict[str, Any], dict[str, Any]]:
    """The class list and dev-1's badge as ``simulate`` decides them: the expected answers."""
    settings = load_settings(CONFIG)
    simulation = Simulation(Engine(settings.rules()))
    list(simulation.feed(lines))
    catalog = simulation.engine.catalog
    classes = gpu_classes(simulation.state, catalog, az=settings.az).model_dump(mode="json")
    badge = vm_badge(simulation.state, catalog, "spx-proj-b", "dev-1")
    assert badge is not None
    return classes, badge.model_dump(mode="json")


class ApiProcess(VmstreamProcess):
    """``vmstream api`` for a deployment: ready when its ``/ready`` says so."""

    def __init__(self, deployment: Deployment, name: str) -> None:
        super().__init__(deployment, name, ["api", "--config", str(CONFIG)])
        self.env = {"VMSTREAM_API__PORT": str(self.web_port), "VMSTREAM_API__OPERATOR_TOKEN": OPERATOR,
                    "VMSTREAM_API__PROJECT_TOKENS": json.dumps(PROJECT_TOKENS),
                    "VMSTREAM_API__PUBLISH_SECONDS": "0.2"}

    def wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.check_running()
            if self.get("/ready")[0] == 200:
                return
            time.sleep(0.2)  # polling interval of a readiness probe
        raise AssertionError(f"api {self.name} not ready after {timeout}s:\n{self.tail()}")

    def get(self, path: str, token: str | None = None, *, method: str = "GET") -> tuple[int, Any]:
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        request = urllib.request.Request(f"http://127.0.0.1:{self.web_port}{path}", headers=headers, method=method,
                                         data=b"{}" if method != "GET" else None)
        try:
            with urllib.request.urlopen(request, timeout=5) as answer:
                return answer.status, json.loads(answer.read())
        except urllib.error.HTTPError as error:
            body = error.read()
            try:
                return error.code, json.loads(body or b"null")
            except ValueError:
                return error.code, body.decode(errors="replace")
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            return 0, None

    def wait_until(self, path: str, condition: Callable[[Any], bool], timeout: float = 60.0) -> Any:
        deadline = time.monotonic() + timeout
        while True:
            status, body = self.get(path, OPERATOR)
            if status == 200 and condition(body):
                return body
            if time.monotonic() > deadline:
                raise AssertionError(f"{self.name} {path} never satisfied the condition: {status} {body}\n{self.tail()}")
            time.sleep(0.1)  # polling interval


class ClassTopic:
    """The latest record per key of vmstream.gpu-classes, read by the test itself."""

    def __init__(self, deployment: Deployment) -> None:
        kafka = deployment.kafka
        self.reader = TopicReader(kafka, [kafka.topic(GPU_CLASSES)], partitions=kafka.partitions)
        self.latest: dict[str, Any] = {}
        self.headers: dict[str, tuple[dict[str, str], bytes | None]] = {}  # the latest record's, and its value

    def wait_for(self, expected: dict[str, Any], timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while self.latest != expected:
            if time.monotonic() > deadline:
                raise AssertionError(f"the topic holds {self.latest}, not {expected}")
            for record in self.reader.poll(0.2):
                key = (record.key or b"").decode()
                self.headers[key] = ({name: value.decode() for name, value in record.headers}, record.value)
                if record.value is None:
                    self.latest.pop(key, None)
                else:
                    self.latest[key] = json.loads(record.value)

    def close(self) -> None:
        self.reader.close()



def test_two_replicas_answer_alike_tokens_are_scoped_and_the_class_topic_is_current(deployment: Deployment) -> None:
    first, patched = scenario()
    expected_classes, _ = simulated(first)
    expected_all_classes, expected_badge = simulated(first + patched)
    assert expected_badge["waits_for"] == "restart" and expected_badge["gpus_after_restart"]
    outputs = Outputs(deployment)
    topic = ClassTopic(deployment)
    worker = WorkerProcess(deployment, "w1")
    apis = [ApiProcess(deployment, "api-1"), ApiProcess(deployment, "api-2")]
    try:
        worker.start()
        for api in apis:
            api.start()
        # The AZ first, decided: an intent and the watch events it names are routed apart, and
        # one about a VM the worker has not seen yet is refused as about no VM.
        *events, intent = first
        deployment.publish_lines(events)
        seen = {"VirtualMachine/spx-proj-b/dev-1", "VirtualMachineInstance/spx-proj-b/dev-1"}
        outputs.wait_for(lambda o: seen <= {a["input"]["key"] for a in o.seen["audit"]}, what="dev-1 observed")
        deployment.publish_lines([intent])
        outputs.wait_for(lambda o: o.audits(input__ref="it-api-gpu-1"), what="the set_gpu decided")
        assert outputs.audits(input__ref="it-api-gpu-1")[0]["outcome"] == "accepted"

        # The pending badge from either replica, as soon as set_gpu was decided.
        for api in apis:
            told = api.wait_until("/v1/vms/spx-proj-b/dev-1", lambda b: b["waits_for"] == "restart")
            assert told["badge"] == "(applies after restart)" and told["owner_told"]
        # A forged "rejected" for the accepted set_gpu, unsealed on the audit topic, changes
        # nothing served: the API reads the worker's tables, never audit records.
        forged = {**outputs.audits(input__ref="it-api-gpu-1")[0], "outcome": "rejected",
                  "reason": "forged: not yours", "commands": [], "notifications": []}
        forged.pop("mac")  # the worker's seal (docs/security.md): a forger has none
        deployment.publish_raw("audit", "vm/spx-proj-b/dev-1", json.dumps(forged).encode())
        outputs.wait_for(lambda o: len(o.audits(input__ref="it-api-gpu-1")) == 2, what="the forged record")
        for api in apis:
            status, badge = api.get("/v1/vms/spx-proj-b/dev-1", OPERATOR)
            assert status == 200 and badge["badge"] == "(applies after restart)" and badge["owner_told"]
        # Once the watch shows the patched template, the GPU after the restart is the new one.
        deployment.publish_lines(patched)
        badges = [api.wait_until("/v1/vms/spx-proj-b/dev-1", lambda b: b == expected_badge) for api in apis]
        assert badges[0] == badges[1] == expected_badge
        assert [g["device_name"] for g in expected_badge["gpus_after_restart"]] == [RTX]
        assert expected_badge["gpus_now"] == []

        classes = [api.wait_until("/v1/gpu-classes", lambda b: b == expected_all_classes) for api in apis]
        assert classes[0] == classes[1] == expected_all_classes == expected_classes
        assert {c["name"] for c in expected_all_classes["classes"]} >= {"nvidia-rtx-pro-6000-bse", "nvidia-a100"}

        # Tokens: none 401, a wrong one 401, another project's VM or project 403, its own 200.
        api = apis[0]
        assert api.get("/v1/gpu-classes")[0] == 401
        assert api.get("/v1/vms/spx-proj-b/dev-1", "not-a-token")[0] == 401
        assert api.get("/v1/vms/spx-proj-b/dev-1", "proj-a-token")[0] == 403
        assert api.get("/v1/projects/proj-b", "proj-a-token")[0] == 403
        status, own = api.get("/v1/vms/spx-proj-b/dev-1", "proj-b-token")
        assert (status, own) == (200, expected_badge)
        status, project = api.get("/v1/projects/proj-b", "proj-b-token")
        assert status == 200 and [b["name"] for b in project["pending"]] == ["dev-1"]
        assert api.get("/v1/gpu-classes", "proj-a-token") == (200, expected_all_classes)
        assert api.get("/v1/vms/spx-proj-b/nope", OPERATOR)[0] == 404
        assert api.get("/v1/vms/spx-proj-b/nope", "proj-a-token")[0] == 403
        # Read-only: nothing but GET is routed.
        assert api.get("/v1/projects/proj-b", OPERATOR, method="POST")[0] == 405
        assert api.get("/v1/vms/spx-proj-b/dev-1", OPERATOR, method="DELETE")[0] == 405

        # The compacted topic: one current record per class, whoever published it.
        topic.wait_for({c["name"]: c for c in expected_all_classes["classes"]})
        # Each with its CloudEvents headers: its id that of the value, its trace derived from the id.
        for name in topic.latest:
            headers, value = topic.headers[name]
            assert value is not None
            assert headers["ce_id"] == f"{name}@{hashlib.sha256(value).hexdigest()[:16]}", headers
            assert headers["ce_type"] == "io.vmstream.gpu-class" and headers["ce_specversion"] == "1.0"
            assert headers["ce_source"] == f"/vmstream/api/{deployment.app_id}"
            assert headers["content-type"] == "application/json" and headers["ce_time"].endswith("Z")
            assert headers["traceparent"] == derived_trace(headers["ce_id"]).child(headers["ce_id"])
        for process in (worker, *apis):
            process.check_running()
    finally:
        topic.close()
        outputs.close()
        for api in apis:
            api.stop()
        worker.stop()


def test_the_class_topic_publishes_what_differs_and_a_tombstone_for_a_class_gone() -> None:
    """No broker: what a replica would publish over a topic holding ``latest``."""
    from handlers.contracts.messages import GPUClassStatus
    from streams.serve.api import ClassTopic

    def status(name: str, free: int) -> GPUClassStatus:
        return GPUClassStatus(name=name, class_id=name, display_name=name, device_name=f"nvidia.com/{name}",
                              undefined=False, permitted=True, total=2, schedulable=2, in_use=2 - free, free=free)

    topic = ClassTopic()
    topic.apply(b"a", status("a", 1).model_dump_json().encode())
    topic.apply(b"gone", status("gone", 0).model_dump_json().encode())
    topic.apply(b"b", status("b", 2).model_dump_json().encode())
    topic.apply(b"b", None)  # a tombstone read back
    changes = topic.changes([status("a", 1), status("b", 0)])
    assert [(name, value is None) for name, value in changes] == [("b", False), ("gone", True)]
    for name, value in changes:
        topic.apply(name.encode(), value)
    assert topic.changes([status("a", 1), status("b", 0)]) == []


def test_a_maintenance_plan_is_served_per_node_per_vm_and_per_owner_each_project_its_own(
        deployment: Deployment) -> None:
    """A plan_maintenance decided by a worker, read from its ``plans`` changelog: the operator
    sees every VM of the plan, a project token only its project's, an unknown plan is 404."""
    lines = list(cluster().jsonl())
    start = datetime.now(UTC) + timedelta(days=2)
    plan = {"intent_id": "it-api-plan-1", "type": "plan_maintenance", "requested_by": "ops@example.com",
            "spec": {"plan": "fw", "nodes": ["gpu-node-1", "gpu-node-2"], "earliest_start": start.isoformat(),
                     "latest_end": (start + timedelta(days=1)).isoformat(), "node_duration_seconds": 3600,
                     "notice_seconds": 86400, "reason": "firmware upgrade"}}
    outputs = Outputs(deployment)
    worker = WorkerProcess(deployment, "w1")
    api = ApiProcess(deployment, "api-1")
    try:
        worker.start()
        api.start()
        deployment.publish_lines(lines)
        worker.wait_for_capacity(capacity_after(lines))
        deployment.publish_lines([json.dumps({"topic": "vmstream.intents", "key": "maintenance/fw", "value": plan})])
        outputs.wait_for(lambda o: o.audits(input__ref="it-api-plan-1"), what="the plan decided")
        assert outputs.audits(input__ref="it-api-plan-1")[0]["outcome"] == "accepted"

        shown = api.wait_until("/v1/plans/fw", lambda b: len(b["vms"]) == 3)
        assert shown["requested_by"] == "ops@example.com" and shown["reason"] == "firmware upgrade"
        assert sorted(n["node"] for n in shown["nodes"]) == ["gpu-node-1", "gpu-node-2"]
        assert {n["phase"] for n in shown["nodes"]} == {"planned"}
        assert sorted(v["name"] for v in shown["vms"]) == ["batch-1", "infer-1", "train-1"]
        status, listed = api.get("/v1/plans", OPERATOR)
        assert status == 200 and [(p["plan"], p["vms"]) for p in listed["plans"]] == [("fw", 3)]

        status, mine = api.get("/v1/plans/fw", "proj-a-token")
        assert status == 200 and mine["requested_by"] is None
        assert sorted(v["name"] for v in mine["vms"]) == ["batch-1", "train-1"]
        assert [n["node"] for n in mine["nodes"]] == ["gpu-node-1"]
        status, theirs = api.get("/v1/plans/fw", "proj-b-token")
        assert status == 200 and [v["name"] for v in theirs["vms"]] == ["infer-1"]
        assert [o["owner"] for o in theirs["owners"]] == [BOB]
        assert api.get("/v1/plans", "proj-b-token")[1]["plans"][0]["vms"] == 1
        assert api.get("/v1/plans/fw")[0] == 401
        assert api.get("/v1/plans/nope", OPERATOR)[0] == 404
        assert api.get("/v1/plans/nope", "proj-a-token")[0] == 404
        for process in (worker, api):
            process.check_running()
    finally:
        outputs.close()
        api.stop()
        worker.stop()
