"""Prometheus metrics of every vmstream process: what came in, what went out, how fast, how
far behind, and what the worker's tables hold.

Each process has a registry of its own (:func:`registry`), and its ``/metrics`` shows only
that: the families it writes, plus those every process has (``vmstream_build_info``, the
process's CPU, memory and file descriptors, Python's garbage collector). A family is declared
once, with the processes that export it (:func:`family`); nothing goes into prometheus_client's
default registry, which would carry every family imported into every process. Served by the
worker's web server, by ``vmstream api``'s, and by :mod:`streams.common.probes` in the applier,
the watch bridge and ``vmstream notify``. Names follow Prometheus conventions (``_total``
counters, ``_seconds`` histograms); docs/operators.md lists them.
"""

from __future__ import annotations

import logging
import platform
from collections.abc import Callable, Iterator, Sequence
from importlib.metadata import PackageNotFoundError, version
from typing import Any, Literal, TypeVar

from prometheus_client import CONTENT_TYPE_LATEST as CONTENT_TYPE_LATEST  # re-exported: the full exposition type
from prometheus_client import (
    GC_COLLECTOR,
    PLATFORM_COLLECTOR,
    PROCESS_COLLECTOR,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from handlers.reads.figures import NO_GPU, Figures
from handlers.reads.plan_counts import PlanCounts

CONTENT_TYPE = CONTENT_TYPE_LATEST.split(";")[0]

Process = Literal["worker", "apply", "watch", "notify", "api"]
PROCESSES: tuple[Process, ...] = ("worker", "apply", "watch", "notify", "api")
C = TypeVar("C", bound=Collector)

_REGISTRIES: dict[str, CollectorRegistry] = {process: CollectorRegistry() for process in PROCESSES}


def registry(process: Process) -> CollectorRegistry:
    """The registry whose families ``process``'s ``/metrics`` shows."""
    return _REGISTRIES[process]


def family(collector: C, *processes: Process) -> C:
    """Register ``collector`` (made with ``registry=None``) with the registries of ``processes``."""
    for process in processes:
        _REGISTRIES[process].register(collector)
    return collector


def vmstream_version() -> str:
    try:
        return version("vmstream")
    except PackageNotFoundError:  # run from a checkout that was never installed
        return "unknown"


BUILD_INFO = family(Gauge("vmstream_build_info", "Always 1: the vmstream version and the Python running it",
                          ["version", "python"], registry=None), *PROCESSES)
BUILD_INFO.labels(vmstream_version(), platform.python_version()).set(1)
for _collector in (PROCESS_COLLECTOR, PLATFORM_COLLECTOR, GC_COLLECTOR):  # process_*, python_*
    family(_collector, *PROCESSES)

PAUSE_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)

# The worker's.
INPUTS = family(Counter("vmstream_inputs_total", "Inputs decided, by topic and audit outcome", ["topic", "outcome"],
                        registry=None), "worker")
OUTPUTS = family(Counter("vmstream_outputs_total", "Messages sent, by logical topic", ["topic"], registry=None),
                 "worker")
DECISION_SECONDS = family(Histogram(
    "vmstream_decision_seconds",
    "Time to decide one input and hand its outputs to the producer",
    ["kind"],
    buckets=PAUSE_BUCKETS,
    registry=None,
), "worker")
TABLE_ROWS = family(Gauge("vmstream_table_rows", "Rows held in each state table on this instance", ["table"],
                          registry=None), "worker")
GC_PAUSE_SECONDS = family(Histogram(
    "vmstream_gc_pause_seconds",
    "Pauses of CPython's garbage collector, by generation (2: full); see streams/common/heap.py",
    ["generation"],
    buckets=PAUSE_BUCKETS,
    registry=None,
), "worker")
GC_FROZEN = family(Gauge("vmstream_gc_frozen_objects", "Objects in CPython's permanent generation, skipped by "
                         "collections", registry=None), "worker")
# The worker's, of maintenance plans (docs/maintenance.md): counted from each decision it applies
# (handlers/reads/plan_counts.py), so each worker counts the plans its partitions decide.
PLAN_VMS_PLANNED = family(Counter("vmstream_maintenance_vms_planned_total", "GPU VMs taken into a maintenance plan "
                                  "(their owner told maintenance_planned), at its making or come on a planned node "
                                  "since", registry=None), "worker")
PLAN_VM_STOPS = family(Counter("vmstream_maintenance_vm_stops_total", "GPU VM stops maintenance plans made: "
                               "vmstream's stop_vm for a plan (an early stop, a VM kept off or back on its node) "
                               "and the stops of the plans' drains", registry=None), "worker")
PLAN_VMS_WAITING = family(Counter("vmstream_maintenance_vms_waiting_for_card_total", "GPU VMs a maintenance plan "
                                  "leaves without a card (fate waits_for_card): planned so, or corrected to it",
                                  registry=None), "worker")
PLAN_ANSWERS = family(Counter("vmstream_maintenance_answers_total", "Answers to a maintenance plan, by intent "
                              "(reschedule_maintenance, maintenance_ready) and outcome (accepted, refused)",
                              ["intent", "outcome"], registry=None), "worker")


def record_plan_counts(counts: PlanCounts) -> None:
    """Add what one decision did to plans to the worker's counters."""
    if counts.planned:
        PLAN_VMS_PLANNED.inc(counts.planned)
    if counts.stops:
        PLAN_VM_STOPS.inc(counts.stops)
    if counts.waits_for_card:
        PLAN_VMS_WAITING.inc(counts.waits_for_card)
    if counts.answer is not None:
        PLAN_ANSWERS.labels(*counts.answer).inc()


# The worker's (its Faust consumer and its route stage), the applier's and notify's (their group readers).
CONSUMER_LAG = family(Gauge("vmstream_consumer_lag", "Messages not yet consumed, per topic partition",
                            ["topic", "partition"], registry=None), "worker", "apply", "notify")

# Every process that reads records sets aside what it cannot read or deliver.
DEAD_LETTERS = family(Counter("vmstream_dead_letters_total", "Records this process set aside on vmstream.dlq, by "
                              "the topic the record was read from", ["topic"], registry=None),
                      "worker", "apply", "watch", "notify")

# The applier's (streams/kube/applying/).
APPLY_RESULTS = family(Counter("vmstream_apply_results_total", "Commands applied, by command type and outcome",
                               ["type", "outcome"], registry=None), "apply")
APPLY_SECONDS = family(Histogram(
    "vmstream_apply_seconds",
    "Time to apply one command to the Kubernetes API, retries included",
    ["type"],
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0),
    registry=None,
), "apply")
API_ERRORS = family(Counter("vmstream_kube_api_errors_total",
                            "Failed Kubernetes API calls (each attempt), by HTTP status or 'connection'", ["status"],
                            registry=None), "apply")



class FiguresCollector(Collector):
    """The worker's gauges of what its tables hold (:mod:`handlers.reads.figures`), counted when
    ``/metrics`` is read: ``source`` is set by the worker, and gives the figures of the
    partitions this instance owns. Without a source (any other process, a worker not
    started) the families are there with no samples."""

    def __init__(self) -> None:
        self.source: Callable[[], Figures] | None = None

    def describe(self) -> list[Metric]:
        return list(self._families(None))

    def collect(self) -> Iterator[Metric]:
        figures = None
        if self.source is not None:
            try:
                figures = self.source()
            except Exception:  # a failing count costs these gauges, never the page
                log.exception("counting the tables' figures failed")
        return self._families(figures)

    @staticmethod
    def _families(figures: Figures | None) -> Iterator[Metric]:
        gpu = ["class", "device"]
        drain = ["node", "source", "scope"]
        total = GaugeMetricFamily("vmstream_gpus_total", "GPU cards of a class on the nodes of this worker's "
                                  "partitions, schedulable or not (sum by class over the workers)", labels=gpu)
        schedulable = GaugeMetricFamily("vmstream_gpus_schedulable", "GPU cards of a class on schedulable nodes "
                                        "(Ready, not cordoned)", labels=gpu)
        used = GaugeMetricFamily("vmstream_gpus_used", "GPU cards of a class held by VMIs on schedulable nodes",
                                 labels=gpu)
        free = GaugeMetricFamily("vmstream_gpus_free", "GPU cards of a class free on schedulable nodes", labels=gpu)
        waiting = GaugeMetricFamily("vmstream_vms_waiting_for_gpu", "GPU VMs whose VMI waits for a card of the class "
                                    "(ErrorUnschedulable)", labels=gpu)
        pending = GaugeMetricFamily("vmstream_vms_pending_restart", "VMs whose GPU change applies after their next "
                                    "restart, by the class they will have (class none: the GPU is taken away)",
                                    labels=gpu)
        drains = GaugeMetricFamily("vmstream_drains_open", "Drains started and not completed")
        started = GaugeMetricFamily("vmstream_drain_started_timestamp_seconds", "When an open drain started",
                                    labels=drain)
        deadline = GaugeMetricFamily("vmstream_drain_deadline_timestamp_seconds", "When an open drain stops the GPU "
                                     "VMs left on its node", labels=drain)
        left = GaugeMetricFamily("vmstream_drain_vms_left", "GPU VMIs an open drain still has on its node",
                                 labels=drain)
        passed = GaugeMetricFamily("vmstream_drain_deadline_passed", "1 once an open drain's deadline fired",
                                   labels=drain)
        if figures is not None:
            for c in figures.classes:
                labels = [c.class_id, c.device_name]
                total.add_metric(labels, c.capacity.total)
                schedulable.add_metric(labels, c.capacity.schedulable)
                used.add_metric(labels, c.capacity.used)
                free.add_metric(labels, c.capacity.free)
                waiting.add_metric(labels, c.waiting_for_gpu)
                pending.add_metric(labels, c.pending_restart)
            pending.add_metric([NO_GPU, ""], figures.pending_without_gpu)
            drains.add_metric([], len(figures.drains))
            for d in figures.drains:
                labels = [d.node, d.source, d.scope]
                started.add_metric(labels, d.started_at.timestamp())
                deadline.add_metric(labels, d.deadline.timestamp())
                left.add_metric(labels, d.vms_left)
                passed.add_metric(labels, 1 if d.deadline_passed else 0)
        yield from (total, schedulable, used, free, waiting, pending, drains, started, deadline, left, passed)


FIGURES = family(FiguresCollector(), "worker")

log = logging.getLogger(__name__)
_LAG_FAILED: set[str] = set()


def child(metric: Any, *labels: str) -> Any:
    """``metric.labels(*labels)``: the series of ``metric`` for these label values."""
    return metric.labels(*labels)


def _lag_failed(what: str, error: Exception) -> None:
    """Say once per kind of failure why lag is not reported (a silent gauge misleads)."""
    if what not in _LAG_FAILED:
        _LAG_FAILED.add(what)
        log.warning("consumer lag not recorded (%s): %s: %s", what, type(error).__name__, error)


def set_lag(topic: str, partition: int, highwater: int | None, position: int | None) -> None:
    """Highwater (the offset the next record will get) minus the next offset to consume."""
    if highwater is not None and position is not None:
        CONSUMER_LAG.labels(topic, str(partition)).set(max(0, highwater - position))


def record_lag(app: Any) -> None:
    """The worker's lag on its input partitions (changelogs left out), from what Faust read.

    Position is the offset after the last record the agents read, else the committed offset;
    a partition never written has no lag; else nothing yet to say. Highwater is aiokafka's,
    from the last fetch response.
    """
    try:
        consumer = app.consumer
        assigned = consumer.assignment()
    except Exception as error:  # not started yet, or stopping
        _lag_failed("no assignment", error)
        return
    read = getattr(consumer, "_read_offset", {})
    committed = getattr(consumer, "_committed_offset", {})
    for tp in assigned:
        if tp.topic.endswith("-changelog"):
            continue
        try:
            highwater = consumer.highwater(tp)
        except Exception as error:  # the partition was revoked meanwhile
            _lag_failed("highwater", error)
            continue
        last = read.get(tp)
        position = last + 1 if last is not None else committed.get(tp)
        if position is None and highwater == 0:
            position = 0  # never written: nothing to read, nothing behind
        set_lag(tp.topic, tp.partition, highwater, position)


def record_aiokafka_lag(consumer: Any) -> None:
    """The lag of an aiokafka consumer of the worker's own (the route stage) on its assigned
    partitions. Position is the offset after the last record it returned, read from its
    subscription state (aiokafka 0.14): the public ``position()`` waits for one to be known."""
    try:
        subscription = consumer._subscription.subscription
        assignment = subscription.assignment if subscription is not None else None
        if assignment is None:
            return  # not assigned yet: nothing to say
        assigned = list(assignment.tps)
    except AttributeError as error:  # another aiokafka
        _lag_failed("aiokafka", error)
        return
    for tp in assigned:
        state = assignment.state_value(tp)
        position = state.position if state is not None and state.has_valid_position else None
        set_lag(tp.topic, tp.partition, consumer.highwater(tp), position)


def exposition(process: Process) -> bytes:
    """``process``'s ``/metrics`` page."""
    return generate_latest(_REGISTRIES[process])


_SUFFIXES = {"counter": ("_total", "_created"), "histogram": ("_bucket", "_sum", "_count", "_created"),
             "summary": ("", "_sum", "_count", "_created"), "info": ("_info",)}


def series_names(process: Process) -> Sequence[str]:
    """Every series name ``process``'s ``/metrics`` may show, samples or not yet (a labelled
    family shows none until a child is made): what a query of a dashboard or a rule may name."""
    return sorted({metric.name + suffix for metric in _REGISTRIES[process].collect()
                   for suffix in _SUFFIXES.get(metric.type, ("",))})
