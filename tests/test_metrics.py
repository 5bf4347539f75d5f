"""Each process's /metrics shows its own families and those every process has, nothing of
the others', though the ``vmstream`` command imports every process's module; the worker's
gauges of its tables; the read API's /metrics."""

from __future__ import annotations

import urllib.request
from datetime import UTC, datetime

import pytest
from prometheus_client import REGISTRY
from prometheus_client.parser import text_string_to_metric_families

import streams.cli.main  # noqa: F401 — imports the applier, the watch bridge and notify, as the command does
import streams.serve.api  # noqa: F401
import streams.worker.app  # noqa: F401
from handlers.reads.figures import ClassFigures, DrainFigures, Figures
from handlers.rules.capacity import Capacity
from streams.common import metrics
from streams.common.probes import ProbeServer

OWN_PREFIXES: dict[metrics.Process, tuple[str, ...]] = {
    "worker": ("vmstream_inputs", "vmstream_outputs", "vmstream_decision", "vmstream_table_rows", "vmstream_gpus_",
               "vmstream_vms_", "vmstream_drain", "vmstream_gc_"),
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
