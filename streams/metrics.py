"""Prometheus metrics of the worker: what came in, what went out, how fast, how far behind.

Served at ``/metrics`` by the worker's web server. Names follow Prometheus conventions
(``_total`` counters, ``_seconds`` histograms).
"""

from __future__ import annotations

from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, Counter, Gauge, Histogram, generate_latest

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
    "Pauses of CPython's garbage collector, by generation (2: full); see streams/heap.py",
    ["generation"],
    buckets=PAUSE_BUCKETS,
)
GC_FROZEN = Gauge("vmstream_gc_frozen_objects", "Objects in CPython's permanent generation, skipped by collections")
CONSUMER_LAG = Gauge("vmstream_consumer_lag", "Messages not yet consumed, per topic partition",
                     ["topic", "partition"])


def record_lag(app: Any) -> None:
    """Highwater minus position for each assigned partition (best effort: never raises)."""
    try:
        consumer = app.consumer
        for tp in consumer.assignment():
            highwater = consumer.highwater(tp)
            position = consumer._last_offset.get(tp) if hasattr(consumer, "_last_offset") else None
            if highwater is not None and position is not None:
                CONSUMER_LAG.labels(tp.topic, str(tp.partition)).set(max(0, highwater - position - 1))
    except Exception:  # metrics must never break the worker
        return


def exposition() -> bytes:
    return generate_latest()
