"""deploy/components/monitoring on a real API server: with prometheus-operator's CRDs (the
ServiceMonitor and PrometheusRule kinds, from the Go module proxy: tools/monitoring/build.sh),
every object of deploy/base plus the component passes a server-side dry run; the
ServiceMonitors select a Service of every process, by the port its /metrics is on, and the
worker's presents the pages' token. promtool's checks of the rules are in
tests/test_monitoring.py."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from typing import Any

import pytest
import yaml
from kubernetes import client
from kubernetes.client.rest import ApiException

from harness.monitoring import operator_crds
from tests.kube.test_deploy import NAMESPACE, RECOMMENDED, ROOT, Api, _apply_order, kustomize
from tests.support.kube_apiserver import Kube

COMPONENT = ROOT / "deploy" / "components" / "monitoring"
Manifest = dict[str, Any]
PROCESSES = {"worker": 6066, "applier": 6067, "watch-bridge": 6068, "notify": 6070, "api": 6069}


@pytest.fixture(scope="module")
def rendered(tmp_path_factory: pytest.TempPathFactory) -> list[Manifest]:
    """deploy/base with the monitoring component, as an overlay would have it."""
    overlay = tmp_path_factory.mktemp("overlay")
    base = yaml.safe_load((ROOT / "deploy" / "base" / "kustomization.yaml").read_text())
    (overlay / "kustomization.yaml").write_text(yaml.safe_dump({
        "apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization",
        "namespace": NAMESPACE,
        "resources": [os.path.relpath(ROOT / "deploy" / "base", overlay)],
        "components": [os.path.relpath(COMPONENT, overlay)],
        "labels": base["labels"],  # as overlays/prod gives a component's objects the recommended labels
    }))
    return kustomize(overlay)


def of_kind(rendered: list[Manifest], kind: str) -> dict[str, Manifest]:
    return {obj["metadata"]["name"]: obj for obj in rendered if obj["kind"] == kind}


def _selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    if any(labels.get(key) != value for key, value in selector.get("matchLabels", {}).items()):
        return False
    for expression in selector.get("matchExpressions", []):
        assert expression["operator"] == "In", expression
        if labels.get(expression["key"]) not in expression["values"]:
            return False
    return True


def test_a_service_monitor_scrapes_every_process_on_its_metrics_port(rendered: list[Manifest]) -> None:
    services = of_kind(rendered, "Service")
    deployments = of_kind(rendered, "Deployment")
    monitors = of_kind(rendered, "ServiceMonitor")
    scraped: dict[str, tuple[str, int]] = {}
    for monitor in monitors.values():
        assert monitor["metadata"]["namespace"] == NAMESPACE
        for service in services.values():
            if _selects(monitor["spec"]["selector"], service["metadata"]["labels"]):
                [endpoint] = monitor["spec"]["endpoints"]
                [port] = [p for p in service["spec"]["ports"] if p["name"] == endpoint["port"]]
                assert endpoint["path"] == "/metrics"
                component = service["metadata"]["labels"]["app.kubernetes.io/component"]
                assert component not in scraped, f"{component} scraped twice"
                scraped[component] = (monitor["metadata"]["name"], port["port"])
                # The Service reaches the Deployment's pods on the container port of that name.
                [deployment] = [d for d in deployments.values()
                                if _selects({"matchLabels": service["spec"]["selector"]},
                                            d["spec"]["template"]["metadata"]["labels"])]
                ports = {p["name"]: p["containerPort"]
                         for p in deployment["spec"]["template"]["spec"]["containers"][0]["ports"]}
                assert ports[port["targetPort"]] == port["port"]
    assert {c: port for c, (_, port) in scraped.items()} == PROCESSES
    worker = monitors[scraped["worker"][0]]["spec"]["endpoints"][0]
    assert worker["authorization"] == {"type": "Bearer", "credentials": {"name": "vmstream-worker-pages",
                                                                         "key": "token"}}
    others = {name for c, (name, _) in scraped.items() if c != "worker"}
    assert all("authorization" not in monitors[name]["spec"]["endpoints"][0] for name in others)


def test_the_component_s_objects_have_the_recommended_labels(rendered: list[Manifest]) -> None:
    ours = [obj for obj in rendered if obj["kind"] in ("ServiceMonitor", "PrometheusRule")
            or (obj["kind"], obj["metadata"]["name"]) in (("ConfigMap", "vmstream-dashboard"),
                                                          ("Service", "vmstream-apply"), ("Service", "vmstream-watch"),
                                                          ("Service", "vmstream-notify"))]
    assert len(ours) == 7
    for obj in ours:
        labels = obj["metadata"]["labels"]
        assert {f"app.kubernetes.io/{key}" for key in RECOMMENDED} <= labels.keys(), obj["metadata"]["name"]
        assert obj["metadata"]["namespace"] == NAMESPACE


def test_the_dashboard_ships_as_a_config_map_for_grafana_s_sidecar(rendered: list[Manifest]) -> None:
    [config_map] = [c for c in of_kind(rendered, "ConfigMap").values() if "vmstream.json" in c.get("data", {})]
    assert config_map["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert json.loads(config_map["data"]["vmstream.json"]) == json.loads((COMPONENT / "dashboard.json").read_text())


@pytest.fixture(scope="module")
def server(kube: Kube) -> Iterator[Api]:
    """The API server, with the ServiceMonitor and PrometheusRule CRDs established."""
    with kube.api_client() as api:
        extensions = client.ApiextensionsV1Api(api)
        names = []
        for path in operator_crds():
            crd = yaml.safe_load(path.read_text())
            names.append(crd["metadata"]["name"])
            try:
                extensions.create_custom_resource_definition(crd)
            except ApiException as exc:
                if exc.status != 409:
                    raise
        deadline = time.monotonic() + 60
        for name in names:
            while not any(c.type == "Established" and c.status == "True"
                          for c in extensions.read_custom_resource_definition(name).status.conditions or []):
                assert time.monotonic() < deadline, f"{name} not established"
                time.sleep(0.2)
        yield Api(api)


@pytest.mark.kube
def test_the_base_with_monitoring_passes_a_server_side_dry_run(server: Api, rendered: list[Manifest]) -> None:
    namespace = next(obj for obj in rendered if obj["kind"] == "Namespace")
    server.apply(namespace, dry_run=False)  # namespaced dry runs need it (left, as tests/kube/test_deploy.py does)
    kinds = set()
    for obj in sorted(rendered, key=_apply_order):
        status, body, warnings = server.apply(obj, dry_run=True)
        assert status in (200, 201), (obj["kind"], body)
        assert warnings == [], (obj["kind"], obj["metadata"]["name"], warnings)
        kinds.add(obj["kind"])
    assert {"ServiceMonitor", "PrometheusRule"} <= kinds


@pytest.mark.kube
def test_a_rule_the_crd_refuses_is_refused(server: Api, rendered: list[Manifest]) -> None:
    """The dry run checks something: a rule without an expression is not a PrometheusRule."""
    [rule] = of_kind(rendered, "PrometheusRule").values()
    broken = json.loads(json.dumps(rule))
    del broken["spec"]["groups"][0]["rules"][0]["expr"]
    with pytest.raises(ApiException) as refused:
        server.apply(broken, dry_run=True)
    assert refused.value.status == 422

