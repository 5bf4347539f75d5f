"""Write deploy/components/monitoring/dashboard.json, the Grafana dashboard of vmstream.

    python tools/monitoring/dashboard.py        # rewrites the file; commit it

Kept as code so that the panels' layout is computed, not hand-placed; the JSON is what ships
(and what tests/kube/test_monitoring.py checks: every query names only series vmstream
exports). Grafana's dashboard schema 39 (Grafana 10 and 11).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

OUT = Path(__file__).resolve().parents[2] / "deploy" / "components" / "monitoring" / "dashboard.json"
DS = {"type": "prometheus", "uid": "${datasource}"}
NS = 'namespace="$namespace"'
CLASS = f'{NS}, class=~"$class"'


def target(expr: str, legend: str = "", *, ref: str = "A", instant: bool = False, table: bool = False) -> dict[str, Any]:
    t: dict[str, Any] = {"datasource": DS, "expr": expr, "legendFormat": legend or "__auto", "refId": ref}
    if instant:
        t["instant"], t["range"] = True, False
    if table:
        t["format"] = "table"
    return t


class Layout:
    def __init__(self) -> None:
        self.panels: list[dict[str, Any]] = []
        self.y = 0
        self.x = 0
        self.row_height = 0

    def row(self, title: str) -> None:
        self._newline()
        self.panels.append({"type": "row", "title": title, "collapsed": False, "id": len(self.panels) + 1,
                            "gridPos": {"h": 1, "w": 24, "x": 0, "y": self.y}, "panels": []})
        self.y += 1

    def _newline(self) -> None:
        if self.x:
            self.y += self.row_height
            self.x, self.row_height = 0, 0

    def add(self, panel: dict[str, Any], w: int, h: int) -> None:
        if self.x + w > 24:
            self._newline()
        panel["id"] = len(self.panels) + 1
        panel["gridPos"] = {"h": h, "w": w, "x": self.x, "y": self.y}
        panel.setdefault("datasource", DS)
        self.panels.append(panel)
        self.x += w
        self.row_height = max(self.row_height, h)


def stat(title: str, expr: str, description: str, *, thresholds: list[dict[str, Any]] | None = None,
         unit: str = "none") -> dict[str, Any]:
    return {
        "type": "stat", "title": title, "description": description, "targets": [target(expr, instant=True)],
        "options": {"reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
                    "colorMode": "background", "graphMode": "none", "textMode": "value"},
        "fieldConfig": {"defaults": {"unit": unit, "thresholds": {"mode": "absolute", "steps": thresholds or [
            {"color": "blue", "value": None}]}}, "overrides": []},
    }


def series(title: str, targets: list[dict[str, Any]], description: str, *, unit: str = "none",
           stack: bool = False) -> dict[str, Any]:
    return {
        "type": "timeseries", "title": title, "description": description, "targets": targets,
        "fieldConfig": {"defaults": {"unit": unit, "custom": {
            "drawStyle": "line", "lineWidth": 2, "fillOpacity": 20 if stack else 0,
            "stacking": {"mode": "normal" if stack else "none", "group": "A"}}}, "overrides": []},
        "options": {"legend": {"displayMode": "table", "placement": "right", "calcs": ["lastNotNull"]},
                    "tooltip": {"mode": "multi", "sort": "desc"}},
    }


def dashboard() -> dict[str, Any]:
    layout = Layout()
    red_at_zero = [{"color": "red", "value": None}, {"color": "orange", "value": 1}, {"color": "green", "value": 2}]
    waiting = [{"color": "green", "value": None}, {"color": "orange", "value": 1}]

    layout.row("GPU class $class: capacity")
    layout.add(stat("Free cards", f"sum(vmstream_gpus_free{{{CLASS}}})",
                    "Cards free on schedulable nodes (Ready, not cordoned), summed over the workers' partitions.",
                    thresholds=red_at_zero), 4, 5)
    layout.add(stat("Used cards", f"sum(vmstream_gpus_used{{{CLASS}}})",
                    "Cards held by GPU VMIs on schedulable nodes."), 4, 5)
    layout.add(stat("Schedulable cards", f"sum(vmstream_gpus_schedulable{{{CLASS}}})",
                    "Cards on schedulable nodes."), 4, 5)
    layout.add(stat("All cards", f"sum(vmstream_gpus_total{{{CLASS}}})",
                    "Cards on every node, cordoned and NotReady ones too."), 4, 5)
    layout.add(stat("VMs waiting for a card", f"sum(vmstream_vms_waiting_for_gpu{{{CLASS}}})",
                    "GPU VMs whose VMI is ErrorUnschedulable: no free card of the class.", thresholds=waiting), 4, 5)
    layout.add(stat("Pending restarts", f"sum(vmstream_vms_pending_restart{{{CLASS}}})",
                    "VMs whose change to this class applies after their next restart.", thresholds=waiting), 4, 5)
    layout.add(series("Cards of $class over time", [
        target(f"sum(vmstream_gpus_used{{{CLASS}}})", "used", ref="A"),
        target(f"sum(vmstream_gpus_free{{{CLASS}}})", "free", ref="B"),
        target(f"sum(vmstream_gpus_total{{{CLASS}}}) - sum(vmstream_gpus_schedulable{{{CLASS}}})",
               "on cordoned or NotReady nodes", ref="C"),
    ], "Used, free and unschedulable cards stacked: their sum is every card of the class.", stack=True), 12, 9)
    layout.add(series("Free cards by class", [
        target(f"sum by (class) (vmstream_gpus_free{{{NS}}})", "{{class}}"),
    ], "Every class's free cards: a flat line at zero is VmstreamNoFreeGPU."), 12, 9)
    layout.add(series("VMs waiting, by class", [
        target(f"sum by (class) (vmstream_vms_waiting_for_gpu{{{NS}}})", "{{class}} waiting for a card", ref="A"),
        target(f"sum by (class) (vmstream_vms_pending_restart{{{NS}}})", "{{class}} pending restart", ref="B"),
    ], "GPU VMs waiting for a card, and VMs whose GPU change waits for a restart (class none: a GPU removed)."),
        24, 8)

    layout.row("Drains in flight")
    layout.add(stat("Open drains", f"sum(vmstream_drains_open{{{NS}}})",
                    "Drains started and not completed, over every worker.", thresholds=waiting), 4, 8)
    layout.add(stat("GPU VMs left on draining nodes", f"sum(vmstream_drain_vms_left{{{NS}}})",
                    "GPU VMIs the open drains still have on their nodes.", thresholds=waiting), 4, 8)
    layout.add({
        "type": "table", "title": "Drains",
        "description": "Each open drain: when it started, its deadline (when vmstream stops the GPU VMs left), "
                       "the time left, and the GPU VMIs still on the node. A red row is past its deadline.",
        "targets": [
            target(f"max by (node, source, scope) (vmstream_drain_started_timestamp_seconds{{{NS}}}) * 1000",
                   ref="started", instant=True, table=True),
            target(f"max by (node, source, scope) (vmstream_drain_deadline_timestamp_seconds{{{NS}}}) * 1000",
                   ref="deadline", instant=True, table=True),
            target(f"max by (node, source, scope) (vmstream_drain_deadline_timestamp_seconds{{{NS}}}) - time()",
                   ref="left", instant=True, table=True),
            target(f"max by (node, source, scope) (vmstream_drain_vms_left{{{NS}}})",
                   ref="vms", instant=True, table=True),
        ],
        "transformations": [
            {"id": "merge", "options": {}},
            {"id": "organize", "options": {
                "excludeByName": {"Time": True},
                "renameByName": {"Value #started": "started", "Value #deadline": "deadline",
                                 "Value #left": "time to deadline", "Value #vms": "GPU VMs left"},
                "indexByName": {"node": 0, "source": 1, "scope": 2, "Value #started": 3, "Value #deadline": 4,
                                "Value #left": 5, "Value #vms": 6}}},
            {"id": "sortBy", "options": {"sort": [{"field": "time to deadline"}]}},
        ],
        "fieldConfig": {"defaults": {"custom": {"align": "auto"}}, "overrides": [
            {"matcher": {"id": "byName", "options": "started"}, "properties": [{"id": "unit", "value": "dateTimeAsIso"}]},
            {"matcher": {"id": "byName", "options": "deadline"}, "properties": [{"id": "unit", "value": "dateTimeAsIso"}]},
            {"matcher": {"id": "byName", "options": "time to deadline"}, "properties": [
                {"id": "unit", "value": "s"},
                {"id": "custom.cellOptions", "value": {"type": "color-background"}},
                {"id": "thresholds", "value": {"mode": "absolute", "steps": [
                    {"color": "red", "value": None}, {"color": "orange", "value": 0}, {"color": "green", "value": 300}]}},
            ]},
        ]},
        "options": {"showHeader": True},
    }, 16, 8)
    layout.add(series("GPU VMs left per draining node", [
        target(f"max by (node) (vmstream_drain_vms_left{{{NS}}})", "{{node}}"),
    ], "Falls to zero as each drain stops its VMs; a line above zero past the deadline is VmstreamDrainPastDeadline."),
        12, 8)
    layout.add(series("Time to each drain's deadline", [
        target(f"max by (node) (vmstream_drain_deadline_timestamp_seconds{{{NS}}}) - time()", "{{node}}"),
    ], "Seconds until vmstream stops the GPU VMs left on each draining node (negative: past it).", unit="s"),
        12, 8)

    layout.row("Pipeline")
    layout.add(series("Worker lag", [
        target(f'sum by (topic) (vmstream_consumer_lag{{{NS}, job="vmstream-worker"}})', "{{topic}}"),
    ], "Records not yet read on the worker's input topics, over every worker (VmstreamWorkerLagging over 1000)."),
        8, 8)
    layout.add(series("Inputs decided", [
        target(f"sum by (outcome) (rate(vmstream_inputs_total{{{NS}}}[5m]))", "{{outcome}}"),
    ], "Intents and watch events decided per second, by audit outcome.", unit="ops"), 8, 8)
    layout.add(series("Commands applied", [
        target(f"sum by (outcome) (rate(vmstream_apply_results_total{{{NS}}}[5m]))", "{{outcome}}"),
    ], "The applier's results per second, by outcome.", unit="ops"), 8, 8)
    layout.add(series("Dead letters", [
        target(f"sum by (job) (increase(vmstream_dead_letters_total{{{NS}}}[15m]))", "{{job}}"),
    ], "Records set aside on vmstream.dlq in the last 15 minutes, by process (VmstreamDeadLetters)."), 8, 8)
    layout.add(series("Notifications delivered", [
        target(f"sum by (channel, outcome) (rate(vmstream_notify_deliveries_total{{{NS}}}[5m]))",
               "{{channel}} {{outcome}}"),
    ], "Deliveries per second by channel and outcome.", unit="ops"), 8, 8)
    layout.add(series("Decision time (p99)", [
        target(f"histogram_quantile(0.99, sum by (le) (rate(vmstream_decision_seconds_bucket{{{NS}}}[5m])))", "p99"),
    ], "The 99th percentile of the time to decide one input.", unit="s"), 8, 8)

    return {
        "title": "vmstream: GPU capacity and drains",
        "uid": "vmstream-gpus",
        "description": "A GPU class's cards, the VMs waiting for one, the drains in flight and the pipeline "
                       "(docs/operators.md, \"Metrics and alerts\").",
        "tags": ["vmstream", "kubevirt", "gpu"],
        "editable": True,
        "schemaVersion": 39,
        "version": 1,
        "refresh": "30s",
        "time": {"from": "now-6h", "to": "now"},
        "timezone": "browser",
        "annotations": {"list": []},
        "templating": {"list": [
            {"name": "datasource", "label": "Prometheus", "type": "datasource", "query": "prometheus",
             "current": {}, "hide": 0},
            {"name": "namespace", "label": "namespace", "type": "query", "datasource": DS,
             "query": {"query": "label_values(vmstream_build_info, namespace)", "refId": "namespace"},
             "definition": "label_values(vmstream_build_info, namespace)", "refresh": 2, "current": {}, "hide": 0},
            {"name": "class", "label": "GPU class", "type": "query", "datasource": DS,
             "query": {"query": 'label_values(vmstream_gpus_total{namespace="$namespace"}, class)', "refId": "class"},
             "definition": 'label_values(vmstream_gpus_total{namespace="$namespace"}, class)', "refresh": 2,
             "multi": True, "includeAll": True, "current": {}, "hide": 0},
        ]},
        "panels": layout.panels,
    }


if __name__ == "__main__":
    OUT.write_text(json.dumps(dashboard(), indent=2) + "\n")
    print(OUT)
