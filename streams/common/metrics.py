"""Prometheus metrics of the worker and the applier: what came in, what went out, how fast,
how far behind.

Served at ``/metrics`` by the worker's web server, and by :mod:`streams.common.probes` in the
applier and the watch bridge. Names follow Prometheus conventions (``_total`` counters,
``_seconds`` histograms).
"""

from __future__ import annotations

import functools
import logging
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST as CONTENT_TYPE_LATEST  # re-exported: the full exposition type
from prometheus_client import Counter, Gauge, Histogram, generate_latest

CONTENT_TYPE = CONTENT_TYPE_LATEST.split(";")[0]

PAUSE_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)

INPUTS = Counter("vmstream_inputs_total", "Inputs decided, by topic and audit outcome", ["topic", "outcome"])
OUTPUTS = Counter("vmstream_outputs_total", "Messages sent, by logical topic", ["topic"])
DECISION_SECONDS = Histogram(
    "vmstream_decision_seconds",
    "Time to decide one input and hand its outputs to the producer",
    ["kind"],
    buckets=PAUSE_BUCKETS,
)
TABLE_ROWS = Gauge("vmstream_table_rows", "Rows held in each state table on this instance", ["table"])
GC_PAUSE_SECONDS = Histogram(
    "vmstream_gc_pause_seconds",
    "Pauses of CPython's garbage collector, by generation (2: full); see streams/common/heap.py",
    ["generation"],
    buckets=PAUSE_BUCKETS,
)
GC_FROZEN = Gauge("vmstream_gc_frozen_objects", "Objects in CPython's permanent generation, skipped by collections")
CONSUMER_LAG = Gauge("vmstream_consumer_lag", "Messages not yet consumed, per topic partition",
                     ["topic", "partition"])


# The applier's (streams/kube/applying.py); the watch bridge reuses the API ones.
APPLY_RESULTS = Counter("vmstream_apply_results_total", "Commands applied, by command type and outcome",
                        ["type", "outcome"])
APPLY_SECONDS = Histogram(
    "vmstream_apply_seconds",
    "Time to apply one command to the Kubernetes API, retries included",
    ["type"],
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0),
)
API_ERRORS = Counter("vmstream_kube_api_errors_total",
                     "Failed Kubernetes API calls (each attempt), by HTTP status or 'connection'", ["status"])

log = logging.getLogger(__name__)
_LAG_FAILED: set[str] = set()


@functools.lru_cache(maxsize=4096)
def child(metric: Any, *labels: str) -> Any:
    """``metric.labels(*labels)``, looked up once: the worker counts several times per input,
    and ``labels`` costs 1.1 µs where the child's ``inc`` costs 0.3 (``timeit``)."""
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


def exposition() -> bytes:
    return generate_latest()
