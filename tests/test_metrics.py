"""Each process's /metrics shows its own families and those every process has, nothing of
the others', though the ``vmstream`` command imports every process's module; the worker's
gauges of its tables; the read API's /metrics."""

from __future__ import annotations

import urllib.request
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from prometheus_client import REGISTRY
from prometheus_client.parser import text_string_to_metric_families

import streams.cli.main  # noqa: F401 — imports the applier, the watch bridge and notify, as the command does
import streams.serve.api  # noqa: F401
import streams.worker.app  # noqa: F401
from handlers.decide.engine import Result
from handlers.reads.figures import ClassFigures, DrainFigures, Figures
from handlers.reads.plan_counts import plan_counts, plan_intent
from handlers.rules.capacity import Capacity
from streams.common import metrics
from streams.common.probes import ProbeServer
from tests.support.harness import START, Harness

OWN_PREFIXES: dict[metrics.Process, tuple[str, ...]] = {
    "worker": ("vmstream_inputs", "vmstream_outputs", "vmstream_decision", "vmstream_table_rows", "vmstream_gpus_",
               "vmstream_vms_", "vmstream_drain", "vmstream_gc_", "vmstream_maintenance_"),
    "apply": ("vmstream_apply_", "vmstream_kube_api_errors"),
    "watch": ("vmstream_watch_",),
    "notify": ("vmstream_notify_",),
    "api": ("vmstream_api_",),
}
EVERY_PROCESS = {"vmstream_build_info", "process_cpu_seconds", "python_info", "python_gc_objects_collected"}
LAG = "vmstream_consumer_lag"
DEAD = "vmstream_dead_letters_total"


def families(process: metrics.Process) -> set[str]:
    return {family.name for family in text_string_to_metric_families(metrics.exposition(process).decode())}


@pytest.mark.parametrize("process", metrics.PROCESSES)
def test_a_process_exports_its_own_families_and_no_other_process_s(process: metrics.Process) -> None:
    shown = families(process)
    assert EVERY_PROCESS <= shown
    for owner, prefixes in OWN_PREFIXES.items():
        own = {name for name in metrics.series_names(owner) if name.startswith(prefixes)}
        assert own, owner
        if owner == process:
            assert own <= set(metrics.series_names(process))
        else:
            assert not {name for name in metrics.series_names(process) if name.startswith(prefixes)}, owner
    assert (LAG in metrics.series_names(process)) == (process in ("worker", "apply", "notify"))
    assert (DEAD in metrics.series_names(process)) == (process != "api")


def test_the_default_registry_holds_no_vmstream_family() -> None:
    assert not [m.name for m in REGISTRY.collect() if m.name.startswith("vmstream_")]


def test_build_info_names_the_version_and_python() -> None:
    [family] = [f for f in text_string_to_metric_families(metrics.exposition("apply").decode())
                if f.name == "vmstream_build_info"]
    [sample] = family.samples
    assert sample.value == 1 and set(sample.labels) == {"version", "python"}


def test_the_probe_server_shows_the_process_s_registry() -> None:
    metrics.API_ERRORS.labels("503").inc()
    with ProbeServer(ready=lambda: True, process="apply") as probes:
        with urllib.request.urlopen(probes.url + "/metrics", timeout=10) as page:
            text = page.read().decode()
    assert 'vmstream_kube_api_errors_total{status="503"}' in text
    assert "vmstream_watch_" not in text and "vmstream_inputs" not in text and "vmstream_build_info" in text


def test_the_worker_s_gauges_count_what_its_source_gives() -> None:
    deadline = datetime(2026, 12, 1, 10, 15, tzinfo=UTC)
    figures = Figures(
        classes=(ClassFigures("nvidia-a100", "nvidia.com/A100", Capacity("nvidia.com/A100", 4, 3, 2, 1), 5, 6),),
        pending_without_gpu=2,
        drains=(DrainFigures("gpu-node-1", "intent", "node", deadline.replace(minute=0), deadline, False, 3),),
    )
    previous = metrics.FIGURES.source
    metrics.FIGURES.source = lambda: figures
    try:
        samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
                   for f in text_string_to_metric_families(metrics.exposition("worker").decode()) for s in f.samples}
    finally:
        metrics.FIGURES.source = previous
    gpu = (("class", "nvidia-a100"), ("device", "nvidia.com/A100"))
    drain = (("node", "gpu-node-1"), ("scope", "node"), ("source", "intent"))
    assert {name: samples[(name, gpu)] for name in ("vmstream_gpus_total", "vmstream_gpus_schedulable",
                                                     "vmstream_gpus_used", "vmstream_gpus_free",
                                                     "vmstream_vms_waiting_for_gpu", "vmstream_vms_pending_restart")
            } == {"vmstream_gpus_total": 4, "vmstream_gpus_schedulable": 3, "vmstream_gpus_used": 2,
                  "vmstream_gpus_free": 1, "vmstream_vms_waiting_for_gpu": 5, "vmstream_vms_pending_restart": 6}
    assert samples[("vmstream_vms_pending_restart", (("class", "none"), ("device", "")))] == 2
    assert samples[("vmstream_drains_open", ())] == 1
    assert samples[("vmstream_drain_deadline_timestamp_seconds", drain)] == deadline.timestamp()
    assert samples[("vmstream_drain_started_timestamp_seconds", drain)] == deadline.timestamp() - 900
    assert samples[("vmstream_drain_vms_left", drain)] == 3
    assert samples[("vmstream_drain_deadline_passed", drain)] == 0


def test_a_failing_count_costs_the_gauges_not_the_page() -> None:
    def broken() -> Figures:
        raise RuntimeError("no tables")

    previous = metrics.FIGURES.source
    metrics.FIGURES.source = broken
    try:
        text = metrics.exposition("worker").decode()
    finally:
        metrics.FIGURES.source = previous
    assert "vmstream_build_info" in text and "vmstream_gpus_free" in text  # the family, without samples


async def test_the_read_api_serves_its_metrics_without_a_token() -> None:
    """``/metrics`` on the read API's port: its requests counted by route, never by path."""
    from aiohttp.test_utils import TestClient, TestServer

    from handlers.contracts.config import Config
    from streams.common.settings import ApiSettings, KafkaSettings
    from streams.serve.api import Api

    api = Api(kafka=KafkaSettings(), app_id="vmstream", rules=Config(az="az1"), conf=ApiSettings(operator_token="op"))
    async with TestClient(TestServer(api.web_app())) as http:
        assert (await http.get("/v1/vms/ns/a", headers={"Authorization": "Bearer op"})).status == 503  # not read yet
        assert (await http.get("/v1/vms/ns/b")).status == 401
        page = await http.get("/metrics")
        assert page.status == 200 and page.content_type == "text/plain"
        text = await page.text()
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for f in text_string_to_metric_families(text) for s in f.samples}
    route = "/v1/vms/{namespace}/{name}"
    assert samples[("vmstream_api_requests_total", (("route", route), ("status", "503")))] >= 1
    assert samples[("vmstream_api_requests_total", (("route", route), ("status", "401")))] >= 1
    assert samples[("vmstream_api_ready", ())] == 0
    assert "vmstream_build_info" in text and "vmstream_inputs" not in text


class Counted(Harness):
    """Counts each decision as the worker does (streams/worker/app.py, ``_count_plans``): against
    the state before its changes, an intent's type read only under a plan's key."""

    intent_type: str | None = None

    def raw_intent(self, raw: Any, *, key: str | None = None, offset: int | None = None) -> Result:
        self.intent_type = plan_intent(key, raw)
        return super().raw_intent(raw, key=key, offset=offset)

    def _keep(self, result: Result) -> Result:
        intent, self.intent_type = self.intent_type, None  # what it forwards is decided apart
        metrics.record_plan_counts(plan_counts(self.state, result.decision, intent))
        return super()._keep(result)


PLAN_SERIES = {
    "planned": ("vmstream_maintenance_vms_planned_total", ()),
    "stops": ("vmstream_maintenance_vm_stops_total", ()),
    "waiting": ("vmstream_maintenance_vms_waiting_for_card_total", ()),
    "rescheduled": ("vmstream_maintenance_answers_total",
                    (("intent", "reschedule_maintenance"), ("outcome", "accepted"))),
    "reschedule_refused": ("vmstream_maintenance_answers_total",
                           (("intent", "reschedule_maintenance"), ("outcome", "refused"))),
    "ready": ("vmstream_maintenance_answers_total", (("intent", "maintenance_ready"), ("outcome", "accepted"))),
}


def plan_samples() -> dict[str, float]:
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for f in text_string_to_metric_families(metrics.exposition("worker").decode()) for s in f.samples}
    return {name: samples.get(series, 0.0) for name, series in PLAN_SERIES.items()}


def counted_since(before: dict[str, float]) -> dict[str, float]:
    return {name: value - before[name] for name, value in plan_samples().items()}


def test_the_worker_counts_vms_planned_stopped_and_the_answers_to_a_plan() -> None:
    from samples.cluster import RTX, node, vm, vmi
    from tests.rules.test_plans import ALICE, BOB, NS, NS_B, OPS, after, cordoned, iso, plan_spec

    before = plan_samples()
    h = Counted()  # tests/rules/test_plans.py's AZ: alice's vm-1 on gpu-node-1, bob's vm-2 and vm-3 on gpu-node-2
    h.observe_all(node("gpu-node-1", gpus={RTX: 2}), node("gpu-node-2", gpus={RTX: 2}), node("gpu-node-3", gpus={RTX: 1}),
                  vm(NS, "vm-1", project="proj-a", owner=ALICE, gpu=RTX), vmi(NS, "vm-1", node_name="gpu-node-1", gpu=RTX),
                  after(vm(NS_B, "vm-2", project="proj-b", owner=BOB, gpu=RTX), "same_node"),
                  vmi(NS_B, "vm-2", node_name="gpu-node-2", gpu=RTX),
                  vm(NS_B, "vm-3", project="proj-b", owner=BOB, gpu=RTX, run_strategy="Manual"),
                  vmi(NS_B, "vm-3", node_name="gpu-node-2", gpu=RTX))
    h.intent("plan_maintenance", plan_spec(), by=OPS, project=None)
    assert counted_since(before)["planned"] == 3 and counted_since(before)["waiting"] == 0
    h.intent("reschedule_maintenance", {"plan": "fw-2026-12", "node": "gpu-node-2",
                                        "start": iso(START + timedelta(hours=2))}, by=OPS, project=None)
    h.intent("reschedule_maintenance", {"plan": "fw-2026-12", "node": "gpu-node-2",
                                        "start": iso(START + timedelta(days=2))}, by=OPS, project=None)
    h.intent("maintenance_ready", {"plan": "fw-2026-12", "namespace": NS_B, "name": "vm-3"}, by=BOB,
             project="proj-b")
    h.tick()  # vm-3 stopped at once: its owner is ready
    assert [c.target.name for c in h.commands("stop_vm")] == ["vm-3"]
    h.wait(24 * 3600)
    h.tick()  # gpu-node-1's slot
    cordoned(h, "gpu-node-1")  # its drain stops vm-1
    assert [c.target.name for c in h.commands("delete_vmi")] == ["vm-1"]
    assert counted_since(before) == {"planned": 3, "stops": 2, "waiting": 0, "rescheduled": 1,
                                     "reschedule_refused": 1, "ready": 1}


def test_the_worker_counts_the_vms_a_plan_leaves_without_a_card_once() -> None:
    from samples.cluster import RTX, node, vm, vmi
    from tests.rules.test_plans import ALICE, NS, OPS, iso, plan_spec

    before = plan_samples()
    h = Counted()
    h.observe_all(node("gpu-node-1", gpus={RTX: 1}), vm(NS, "vm-1", project="proj-a", owner=ALICE, gpu=RTX),
                  vmi(NS, "vm-1", node_name="gpu-node-1", gpu=RTX))
    h.intent("plan_maintenance", plan_spec(nodes=["gpu-node-1"]), by=OPS, project=None)
    assert counted_since(before) == {**dict.fromkeys(PLAN_SERIES, 0.0), "planned": 1, "waiting": 1}
    # Moved later, it is told again and still waits: not counted a second time.
    h.intent("reschedule_maintenance", {"plan": "fw-2026-12", "node": "gpu-node-1",
                                        "start": iso(START + timedelta(days=2))}, by=OPS, project=None)
    assert counted_since(before)["waiting"] == 1 and counted_since(before)["rescheduled"] == 1
